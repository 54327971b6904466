"""Block quantisation for gradient sync: the pure-torch reference, and dispatch to Triton.

Layout: a 2-D fp32 view `x[rows, cols]` (a row is one destination chunk of a reduce-scatter),
cut into blocks of `block` consecutive columns inside each row (a block never straddles two
destinations; the last block of a row may be short). Each block gets one fp32 scale

    scale = absmax(block) / QMAX          (QMAX = 127 for int8, 448 for fp8 e4m3fn)

and each value the code of `x / scale`: round-to-nearest-even to an int8 for "int8", the
nearest float8_e4m3fn for "fp8". Codes travel as uint8 (gloo refuses fp8 dtypes).
Dequantised value = decode(code) * scale, so per element

    int8:  |x - deq| <= scale / 2                      = absmax / 254
    fp8:   |x - deq| <= 2**-4 * |x| + 2**-10 * scale  (3 mantissa bits; subnormal floor)

(plus 2**-22 |x| for the fp32 roundings of the divide and multiply, see `error_bound`).

With a residual (error feedback), the input is `x + residual` and the residual becomes what
the codes failed to carry, `(x + residual) - deq`, so the errors telescope over steps.

The Triton kernels in `triton_kernels.py` compute the same IEEE operations in the same order;
tests assert the two paths agree bitwise.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

QMAX = {"int8": 127.0, "fp8": 448.0}
KINDS = tuple(QMAX)


def num_blocks(cols: int, block: int) -> int:
    return math.ceil(cols / block)


def _check(kind: str, block: int) -> None:
    if kind not in QMAX:
        raise ValueError(f"unknown quantisation kind {kind!r}; use one of {KINDS}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block}")


# ------------------------------------------------------------------------------------------
# Pure torch reference (the CPU path)


def _encode(y: torch.Tensor, kind: str) -> torch.Tensor:
    """y is a fresh temporary: rounded and clamped in place."""
    if kind == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _decode(q: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "int8":
        return q.view(torch.int8).to(torch.float32)
    # A 256-entry table built from torch's own float8_e4m3fn -> fp32 conversion: same values,
    # ~2x faster than the element-wise fp8 cast on CPU.
    table = _FP8_TABLES.get(q.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32, device=q.device).to(torch.uint8)
        table = _FP8_TABLES[q.device] = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return torch.index_select(table, 0, q.reshape(-1).to(torch.int32)).view(q.shape)


def _tiles(x: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, cols] -> [rows, blocks, block], zero-padded at the end of each row."""
    rows, cols = x.shape
    nb = num_blocks(cols, block)
    if nb * block != cols:
        x = F.pad(x, (0, nb * block - cols))
    return x.view(rows, nb, block)


def quantize_torch(
    x: torch.Tensor, block: int, kind: str, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols], scales fp32 [rows, blocks]); updates `residual` in place."""
    _check(kind, block)
    rows, cols = x.shape
    c = x.to(torch.float32)
    if residual is not None:
        c = c + residual
    tiles = _tiles(c, block)
    scale = tiles.abs().amax(dim=-1) / QMAX[kind]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = _encode(tiles / safe[..., None], kind)  # [rows, blocks, block]
    if residual is not None:
        deq = _decode(codes, kind).mul_(scale[..., None])
        residual.copy_(tiles.sub_(deq).view(rows, -1)[:, :cols])  # tiles is c's own buffer now
    return codes.view(rows, -1)[:, :cols].contiguous(), scale


def dequantize_torch(q: torch.Tensor, scale: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    """fp32 [rows, cols] = decode(codes) * scale of their block."""
    rows, cols = q.shape
    return (_decode(_tiles(q, block), kind) * scale[..., None]).view(rows, -1)[:, :cols]


def dequantize_accumulate_torch(
    q: torch.Tensor, scale: torch.Tensor, block: int, kind: str, divisor: float = 1.0
) -> torch.Tensor:
    """fp32 [cols] = (sum over rows, in row order, of dequantised rows) / divisor."""
    acc = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):  # fixed order: bitwise equal to the Triton kernel's loop
        acc += dequantize_torch(q[r : r + 1], scale[r : r + 1], block, kind)[0]
    return acc / divisor


# ------------------------------------------------------------------------------------------
# Dispatch: Triton on GPUs (or forced, e.g. under TRITON_INTERPRET=1 in tests), torch elsewhere


def _use_triton(x: torch.Tensor, impl: str) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if not x.is_cuda or os.environ.get("SMP_COLLECTIVES_NO_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize(x, block, kind, residual=None, impl="auto"):
    """Quantise `x[rows, cols]` per block; see the module docstring. `impl`: auto|torch|triton."""
    if _use_triton(x, impl):
        from smp_collectives import triton_kernels

        return triton_kernels.quantize(x, block, kind, residual)
    return quantize_torch(x, block, kind, residual)


def dequantize(q, scale, block, kind, impl="auto"):
    if _use_triton(q, impl):
        from smp_collectives import triton_kernels

        return triton_kernels.dequantize(q, scale, block, kind)
    return dequantize_torch(q, scale, block, kind)


def dequantize_accumulate(q, scale, block, kind, divisor=1.0, impl="auto"):
    if _use_triton(q, impl):
        from smp_collectives import triton_kernels

        return triton_kernels.dequantize_accumulate(q, scale, block, kind, divisor)
    return dequantize_accumulate_torch(q, scale, block, kind, divisor)


def error_bound(x: torch.Tensor, scale: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    """The analytic per-element bound on |x - dequantize(quantize(x))| (see module docstring)."""
    s = scale.repeat_interleave(block, dim=1)[:, : x.shape[1]]
    # 2**-22 |x|: the fp32 roundings of x / scale and code * scale (2**-24 each), with margin.
    fp32_slack = x.abs() * 2.0**-22
    if kind == "int8":
        return s / 2 + fp32_slack
    # e4m3: 3 stored mantissa bits -> relative half-ulp 2**-4 for normals; below 2**-6 (in
    # units of the scale) the spacing is fixed at 2**-9, half of it 2**-10.
    return x.abs() * 2.0**-4 + s * 2.0**-10 + fp32_slack
