"""Timing on a CUDA device: CUDA events around the work, the median of repeats."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def cuda_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds of one `fn()` call on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
