"""The block-quantisation formats: the kinds, their largest code, the block layout and its checks.

Shared by the torch reference (quantization.py) and the Triton kernels (triton_kernels.py);
imports nothing, so both can import it.
"""

from __future__ import annotations

import math

# Largest code magnitude of each kind: int8 codes are -127..127 (symmetric; -128 unused), fp8
# e4m3fn's largest finite value is 448.
QMAX = {"int8": 127.0, "fp8": 448.0}
KINDS = tuple(QMAX)


def num_blocks(cols: int, block: int) -> int:
    """Blocks in a row of `cols` values (the last one may be short)."""
    return math.ceil(cols / block)


def check_format(kind: str, block: int) -> None:
    """Raise ValueError unless `kind` is one of KINDS and `block` a power of two >= 16."""
    if kind not in QMAX:
        raise ValueError(f"unknown quantisation kind {kind!r}; use one of {KINDS}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block}")
