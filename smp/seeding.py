"""Seeding: the same `random_seed` gives the same model init and data order on every rank."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
