"""Fused Triton kernels for block quantisation: quantise(+error feedback), dequantise(+accumulate).

One fused pass replaces the torch chain (add residual, abs, amax, divide, round, cast, decode,
multiply, subtract: ~9 kernels and as many round trips through memory).

Every operation is an IEEE fp32 add/multiply/correctly-rounded divide (`tl.div_rn`) or an
integer bit operation, in the same order as the torch reference in `quantization.py`, so the two
agree bitwise. Two deliberate choices make that hold under TRITON_INTERPRET=1 too, whose
float->int8/fp8 casts truncate instead of rounding (see docs/platform.md):
  * round-to-nearest-even by the magic-number trick `(y + 1.5 * 2**23) - 1.5 * 2**23` (exact
    for |y| < 2**22) before any cast, so every cast is of a value that is already exact;
  * fp8 e4m3fn codes built with integer operations on the fp32 bits, never a float8 cast.
Inputs may be fp32/bf16/fp16: they are converted to fp32 on load, all arithmetic is fp32.
Kernels launch with `enable_fp_fusion=False`: a fused multiply-add (`acc += code * scale`,
`residual = c - code * scale`) rounds once where torch rounds twice, which would break bitwise
equality on GPUs (the interpreter never fuses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from smp_collectives.formats import QMAX, check_format, num_blocks

# Elements per program, and warps per program on a GPU. The interpreter (CPU tensors) pays per
# program, so it gets few large ones; on an H100 1024 elements x 8 warps moved the most bytes
# (dequantise + accumulate of 8 rows: 0.80 of a device copy's bandwidth, vs 0.70 at 4096 x 4).
_TILE_INTERPRETED, _TILE_GPU, _WARPS_GPU = 4096, 1024, 8


@triton.jit
def _round_half_even(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _encode(y, IS_FP8: tl.constexpr):
    """y (fp32, already divided by the block scale) -> uint8 code."""
    if IS_FP8:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        a = tl.abs(y)
        # e = floor(log2 a) from the exponent field, floored at e4m3's min normal exponent -6;
        # below it the spacing stays 2**-9 (subnormals).
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        inv_quantum = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e), exact
        r = _round_half_even(a * inv_quantum).to(tl.int32)  # 0..16, exact integer
        # code = exponent field * 8 + mantissa; r = 16 carries into the next binade and
        # r = 8 in the subnormal range is the smallest normal: both fall out of this sum.
        code = (e + 6) * 8 + r
        code = tl.where(bits < 0, code | 0x80, code)
        return code.to(tl.uint8)
    else:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return _round_half_even(y).to(tl.int8).to(tl.uint8, bitcast=True)


@triton.jit
def _decode(q, IS_FP8: tl.constexpr):
    """uint8 code -> fp32 value (before the block scale)."""
    if IS_FP8:
        c = q.to(tl.int32)
        m7 = c & 0x7F
        ex = m7 >> 3
        man = m7 & 7
        mant = tl.where(ex > 0, man + 8, man).to(tl.float32)
        p2 = ((tl.maximum(ex, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2**(ex - 10)
        v = mant * p2
        return tl.where(c >= 0x80, -v, v)
    else:
        return q.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _quantize_kernel(
    x_ptr, res_ptr, q_ptr, scale_ptr, cols, nb, qmax,
    HAS_RES: tl.constexpr, IS_FP8: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    # Blocks on grid axis 0 (up to 2**31 - 1 programs), rows on axis 1 (CUDA caps y at 65535):
    # a large FSDP unit's chunk has far more blocks than any limit on axis 1 allows.
    row = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * GROUP + tl.arange(0, GROUP)  # [GROUP] block indices in the row
    col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUP, BLOCK]
    mask = (col < cols) & (blk[:, None] < nb)
    offs = row * cols + col
    c = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        c = c + tl.load(res_ptr + offs, mask=mask, other=0.0)
    scale = tl.div_rn(tl.max(tl.abs(c), axis=1), qmax)  # [GROUP]
    safe = tl.where(scale > 0, scale, 1.0)
    q = _encode(tl.div_rn(c, safe[:, None]), IS_FP8)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(scale_ptr + row * nb + blk, scale, mask=blk < nb)
    if HAS_RES:
        tl.store(res_ptr + offs, c - _decode(q, IS_FP8) * scale[:, None], mask=mask)


@triton.jit
def _dequantize_accumulate_kernel(
    q_ptr, scale_ptr, out_ptr, rows, cols, nb, divisor,
    IS_FP8: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    # Grid axis 1 picks an independent output row (`dequantize`: one launch for all rows); the
    # accumulating reduce-scatter launches one row of programs that sums `rows` input rows.
    out_row = tl.program_id(1).to(tl.int64)
    q_ptr += out_row * rows * cols
    scale_ptr += out_row * rows * nb
    out_ptr += out_row * cols
    blk = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (col < cols) & (blk[:, None] < nb)
    acc = tl.zeros((GROUP, BLOCK), dtype=tl.float32)
    for _ in range(rows):  # row order fixed: the sum is deterministic and matches torch
        q = tl.load(q_ptr + col, mask=mask, other=0)
        s = tl.load(scale_ptr + blk, mask=blk < nb, other=0.0)
        acc += _decode(q, IS_FP8) * s[:, None]
        q_ptr += cols  # pointer arithmetic is 64-bit: no int32 overflow on big buffers
        scale_ptr += nb
    tl.store(out_ptr + col, tl.div_rn(acc, divisor), mask=mask)


def _launch(block: int, device: torch.device) -> tuple[int, dict]:
    """(blocks per program, launch options) for tensors on `device`."""
    if device.type == "cpu":
        return max(1, _TILE_INTERPRETED // block), {"enable_fp_fusion": False}
    return max(1, _TILE_GPU // block), {"enable_fp_fusion": False, "num_warps": _WARPS_GPU}


def quantize(
    x: torch.Tensor, block: int, kind: str, residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
):
    """(codes uint8 [rows, cols], scales fp32 [rows, blocks]), written into `out` / `scale_out`
    when given (contiguous; e.g. slices of one message buffer, so no copy follows)."""
    check_format(kind, block)
    x = x.contiguous()
    rows, cols = x.shape
    nb = num_blocks(cols, block)
    q = out if out is not None else torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale = scale_out if scale_out is not None else torch.empty((rows, nb), dtype=torch.float32, device=x.device)
    assert q.is_contiguous() and q.dtype == torch.uint8 and q.numel() == rows * cols
    assert scale.is_contiguous() and scale.dtype == torch.float32 and scale.numel() == rows * nb
    if residual is not None:
        assert residual.is_contiguous() and residual.dtype == torch.float32 and residual.shape == x.shape
    group, options = _launch(block, x.device)
    grid = (triton.cdiv(nb, group), rows)
    _quantize_kernel[grid](
        x, residual if residual is not None else x, q, scale, cols, nb, QMAX[kind],
        HAS_RES=residual is not None, IS_FP8=kind == "fp8", BLOCK=block, GROUP=group, **options,
    )
    return q, scale


def dequantize_accumulate(
    q: torch.Tensor, scale: torch.Tensor, block: int, kind: str, divisor: float = 1.0, out: torch.Tensor | None = None
):
    check_format(kind, block)
    rows, cols = q.shape
    nb = num_blocks(cols, block)
    if out is None:
        out = torch.empty(cols, dtype=torch.float32, device=q.device)
    assert out.is_contiguous() and out.dtype == torch.float32 and out.numel() == cols
    group, options = _launch(block, q.device)
    _dequantize_accumulate_kernel[(triton.cdiv(nb, group),)](
        q.contiguous(), scale.contiguous(), out, rows, cols, nb, float(divisor),
        IS_FP8=kind == "fp8", BLOCK=block, GROUP=group, **options,
    )
    return out


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: int, kind: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row decoded on its own (no sum), in one launch: rows on grid axis 1."""
    check_format(kind, block)
    rows, cols = q.shape
    nb = num_blocks(cols, block)
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32, device=q.device)
    assert out.is_contiguous() and out.dtype == torch.float32 and out.numel() == rows * cols
    group, options = _launch(block, q.device)
    _dequantize_accumulate_kernel[(triton.cdiv(nb, group), rows)](
        q.contiguous(), scale.contiguous(), out, 1, cols, nb, 1.0,
        IS_FP8=kind == "fp8", BLOCK=block, GROUP=group, **options,
    )
    return out


# ------------------------------------------------------------------------------------------
# Parameter all-gather: rows of a gathered message, decoded straight into the parameter dtype


@triton.jit
def _dequantize_message_kernel(
    msg_ptr, scale_ptr, out_ptr, cols, nb, width, codes_at,
    OUT_BF16: tl.constexpr, IS_FP8: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    # Row r of the message (width bytes): nb fp32 scales, then cols codes (parameter_gather.py). The
    # same buffer comes in twice: as bytes (msg_ptr) and as fp32 words (scale_ptr).
    row = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    col = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (col < cols) & (blk[:, None] < nb)
    q = tl.load(msg_ptr + row * width + codes_at + col, mask=mask, other=0)
    s = tl.load(scale_ptr + row * (width // 4) + blk, mask=blk < nb, other=0.0)
    v = _decode(q, IS_FP8) * s[:, None]
    if OUT_BF16:
        # fp32 -> bf16, round to nearest even on the bits (the interpreter's cast truncates):
        # add 0x7FFF plus the lowest kept bit, keep the high half. Exact for finite values.
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + row * cols + col, bits.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + row * cols + col, v, mask=mask)


def dequantize_message(
    message: torch.Tensor, cols: int, block: int, kind: str, out: torch.Tensor
) -> torch.Tensor:
    """`out` [rows, cols] (fp32 or bf16, contiguous) = each row of the gathered `message`
    (uint8 [rows, width], see message.py) decoded and scaled, in one pass."""
    check_format(kind, block)
    rows, width = message.shape
    nb = num_blocks(cols, block)
    assert message.is_contiguous() and message.dtype == torch.uint8 and width % 4 == 0
    assert out.is_contiguous() and out.numel() == rows * cols and out.dtype in (torch.float32, torch.bfloat16)
    group, options = _launch(block, message.device)
    out_bf16 = out.dtype == torch.bfloat16
    _dequantize_message_kernel[(triton.cdiv(nb, group), rows)](
        message, message.view(torch.float32), out.view(torch.int16) if out_bf16 else out,
        cols, nb, width, 4 * nb,
        OUT_BF16=out_bf16, IS_FP8=kind == "fp8", BLOCK=block, GROUP=group, **options,
    )
    return out
