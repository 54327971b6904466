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

import os

import torch

from smp_collectives.formats import QMAX, check_format, num_blocks


# ------------------------------------------------------------------------------------------
# Pure torch reference (the CPU path)
#
# The same IEEE operations as the fused kernels, run as separate torch ops, so two things
# decide its speed on CPU: (1) fresh bucket-sized buffers are new mmaps that page-fault on
# first touch, which costs more than the arithmetic (32 MiB: ~20 ms to allocate and touch vs
# ~3 ms to compute), so everything is written in place into small reused workspaces; (2) each
# op is one pass over memory, so the bucket is processed in column spans of ~2 MiB of fp32
# that stay in cache across the ~12 ops (1.8x faster than whole-bucket passes at 64 MiB).
# Blocks never straddle spans, so results do not depend on the span. Not thread-safe: one
# quantised collective at a time per device, which is how FSDP2 calls them.

_SPAN_ELEMENTS = 2**19  # rows x span columns per pass: 2 MiB of fp32
_MIN_SPAN_COLS = 2**14  # with many rows, keep spans long enough to amortise per-op overhead

_WORKSPACE: dict[tuple[torch.device, str], torch.Tensor] = {}


def _workspace(device: torch.device, slot: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A flat buffer of at least `numel` elements, kept for the next call (grown, never shrunk).
    Its contents are garbage; a slot is one caller's, valid until that caller's next call.

    CPU only: there every op runs to completion in the calling thread, so reuse is safe. On
    GPUs FSDP2 runs reduce-scatters and all-reduce hooks on different streams, where a shared
    buffer could be overwritten in flight; the caching allocator makes fresh buffers cheap there.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buf = _WORKSPACE.get((device, slot))
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = _WORKSPACE[(device, slot)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def release_workspace() -> None:
    """Free the cached workspaces (span scratch, and the message buffers of the last bucket)."""
    _WORKSPACE.clear()


def _divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-d tensor on `like`'s device, to divide by. CUDA divides by a Python (CPU)
    scalar as a multiply by its reciprocal, which can differ from the division in the last bit;
    by a device tensor it divides (IEEE, correctly rounded) as the CPU and the kernels do."""
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _spans(rows: int, cols: int, block: int):
    """Column ranges [c0, c1) of ~_SPAN_ELEMENTS elements over all rows, cut at block edges."""
    span = max(block, max(_MIN_SPAN_COLS, _SPAN_ELEMENTS // rows) // block * block)
    for c0 in range(0, cols, span):
        yield c0, min(cols, c0 + span)


def _encode_into(codes: torch.Tensor, y: torch.Tensor, kind: str) -> None:
    """codes (uint8) = code of y; y (fp32 scratch, already divided by the scale) is clobbered."""
    if kind == "int8":
        codes.view(torch.int8).copy_(y.round_().clamp_(-127, 127))
    else:
        codes.view(torch.float8_e4m3fn).copy_(y.clamp_(-448.0, 448.0))


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _decode_into(values: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """values (fp32, rows contiguous) = decode(q); same shape. Returns `values`."""
    if kind == "int8":
        return values.copy_(q.view(torch.int8))
    # fp8: a 256-entry table built from torch's own float8_e4m3fn -> fp32 conversion (same
    # values), ~5x faster on CPU than the element-wise fp8 cast.
    table = _FP8_TABLES.get(q.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32, device=q.device).to(torch.uint8)
        table = _FP8_TABLES[q.device] = codes.view(torch.float8_e4m3fn).to(torch.float32)
    index = _workspace(q.device, "fp8-index", q.numel(), torch.int32).view(q.shape).copy_(q)
    if values.is_contiguous():
        torch.index_select(table, 0, index.view(-1), out=values.view(-1))
    else:
        for r in range(values.shape[0]):
            torch.index_select(table, 0, index[r], out=values[r])
    return values


def _quantize_span(x, block, kind, residual, codes, scale) -> None:
    """One column span: codes [rows, c] and scale [rows, ceil(c / block)] written in place."""
    rows, cols = x.shape
    nb = scale.shape[1]
    work = _workspace(x.device, "quantize", rows * nb * block).view(rows, nb * block)
    body = work[:, :cols]
    if residual is not None:
        torch.add(x, residual, out=body)  # promotes bf16/fp16 x to fp32 exactly, then one fp32 add
        residual.copy_(body)  # c = x + residual, kept to subtract what the codes carry
    else:
        body.copy_(x)
    work[:, cols:].zero_()  # the short last block of each row is padded with zeros
    tiles = work.view(rows, nb, block)
    # absmax = max(max, -min): two fast reductions instead of abs() over the whole span;
    # abs_() turns a -0.0 from an all-zero block into the +0.0 that abs().amax() would give.
    torch.maximum(tiles.amax(dim=-1), tiles.amin(dim=-1).neg_(), out=scale).abs_().div_(_divisor(QMAX[kind], scale))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    _encode_into(codes, tiles.div_(safe[..., None]).view(rows, -1)[:, :cols], kind)
    if residual is not None:
        _decode_into(body, codes, kind)
        tiles.mul_(scale[..., None])  # padding decodes to 0 and stays 0
        residual.sub_(body)


def quantize_torch(
    x: torch.Tensor, block: int, kind: str, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols], scales fp32 [rows, blocks]); updates `residual` in place.
    `out`: where the codes go (uint8 [rows, cols], rows contiguous; e.g. a message buffer);
    `scale_out`: where the scales go (fp32 [rows, blocks])."""
    check_format(kind, block)
    rows, cols = x.shape
    codes = out if out is not None else torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale = scale_out if scale_out is not None else torch.empty(
        (rows, num_blocks(cols, block)), dtype=torch.float32, device=x.device)
    for c0, c1 in _spans(rows, cols, block):
        _quantize_span(
            x[:, c0:c1], block, kind, residual[:, c0:c1] if residual is not None else None,
            codes[:, c0:c1], scale[:, c0 // block : num_blocks(c1, block)],
        )
    return codes, scale


def _dequantize_into(values: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int, kind: str):
    """values[c] = decode(q[c]) * scale of its block, for one row's span; returns values[:c]."""
    cols = q.shape[0]
    nb = scale.shape[0]
    _decode_into(values[:cols], q, kind)
    values[cols:].zero_()
    values.view(nb, block).mul_(scale[:, None])
    return values[:cols]


def dequantize_torch(
    q: torch.Tensor, scale: torch.Tensor, block: int, kind: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [rows, cols] = decode(codes) * scale of their block (into `out` if given)."""
    rows, cols = q.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32, device=q.device)
    for c0, c1 in _spans(1, cols, block):
        b0, b1 = c0 // block, num_blocks(c1, block)
        scratch = _workspace(q.device, "dequantize", (b1 - b0) * block)
        for r in range(rows):
            out[r, c0:c1].copy_(_dequantize_into(scratch, q[r, c0:c1], scale[r, b0:b1], block, kind))
    return out


def dequantize_accumulate_torch(
    q: torch.Tensor, scale: torch.Tensor, block: int, kind: str, divisor: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [cols] = (sum over rows, in row order, of dequantised rows) / divisor, into `out`
    (a contiguous fp32 [cols]) if given."""
    rows, cols = q.shape
    acc = out.view(-1) if out is not None else torch.empty(cols, dtype=torch.float32, device=q.device)
    for c0, c1 in _spans(1, cols, block):
        b0, b1 = c0 // block, num_blocks(c1, block)
        scratch = _workspace(q.device, "dequantize", (b1 - b0) * block)
        span = acc[c0:c1].zero_()
        for r in range(rows):  # fixed order: bitwise equal to the Triton kernel's loop
            span += _dequantize_into(scratch, q[r, c0:c1], scale[r, b0:b1], block, kind)
        span.div_(_divisor(divisor, span))
    return acc


# ------------------------------------------------------------------------------------------
# Dispatch: Triton on GPUs (or forced, e.g. under TRITON_INTERPRET=1 in tests), torch elsewhere
# (triton_kernels is imported on first use: it imports triton, an optional dependency).


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


def quantize(x, block, kind, residual=None, impl="auto", out=None, scale_out=None):
    """Quantise `x[rows, cols]` per block; see the module docstring. `impl`: auto|torch|triton.
    `out`: optional uint8 [rows, cols] destination for the codes (returned as the codes);
    `scale_out`: optional fp32 [rows, blocks] destination for the scales."""
    if _use_triton(x, impl):
        from smp_collectives import triton_kernels

        if (out is None or out.is_contiguous()) and (scale_out is None or scale_out.is_contiguous()):
            return triton_kernels.quantize(x, block, kind, residual, out=out, scale_out=scale_out)
        codes, scale = triton_kernels.quantize(x, block, kind, residual)
        if scale_out is not None:
            scale = scale_out.copy_(scale)
        return (out.copy_(codes) if out is not None else codes), scale
    return quantize_torch(x, block, kind, residual, out, scale_out)


def dequantize(q, scale, block, kind, impl="auto", out=None):
    """fp32 [rows, cols]: each row of `q` dequantised (into `out` if given)."""
    if _use_triton(q, impl):
        from smp_collectives import triton_kernels

        return triton_kernels.dequantize(q, scale, block, kind, out)
    return dequantize_torch(q, scale, block, kind, out)


def dequantize_accumulate(q, scale, block, kind, divisor=1.0, impl="auto", out=None):
    """fp32 [cols]: the rows of `q` dequantised and summed in row order, / divisor (into `out`)."""
    if _use_triton(q, impl):
        from smp_collectives import triton_kernels

        return triton_kernels.dequantize_accumulate(q, scale, block, kind, divisor, out)
    return dequantize_accumulate_torch(q, scale, block, kind, divisor, out)


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
