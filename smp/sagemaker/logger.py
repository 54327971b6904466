"""`torch.sagemaker.logger.get_logger`: a standard library logger under smp's name."""

from __future__ import annotations

import logging


def get_logger(name: str = "smp.sagemaker") -> logging.Logger:
    return logging.getLogger(name)
