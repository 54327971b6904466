"""`torch.sagemaker.utils.utils`: `timeit`."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

from smp.sagemaker._guide import unsupported_module_getattr

log = logging.getLogger("smp.sagemaker")


@contextlib.contextmanager
def timeit(enabled: bool = True, message: str = "", rank: int = 0) -> Iterator[None]:
    """Log how long the block took (on rank 0 only, as SMP's does), at INFO level."""
    start = time.perf_counter()
    yield
    if enabled and rank == 0:
        log.info("%s took %.3f s", message or "block", time.perf_counter() - start)


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.utils.utils", "names", "see the guide's table for the smp equivalent"
)
