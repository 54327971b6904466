"""Timing on a CUDA device: CUDA events around the work, the median of repeats."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def cuda_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median device seconds of one `fn()` call on the current CUDA stream.

    The repeats are queued back to back and synchronised once at the end, so each pair of
    events times the kernels, not the host's launch of them: synchronising after every call
    left the device idle from the start event until the launch arrived, which for a 40 us
    kernel (a dequantise of 100 MB on an H100) is most of what was timed."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
