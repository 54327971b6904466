"""Parameter all-gather with block-quantised codes (DeepSpeed ZeRO++'s qwZ), as an FSDP2 AllGather.

FSDP2 calls `comm(output_tensor=, input_tensor=, group=, async_op=)` with `input_tensor` this
rank's flat shard of one unit's parameters (all of them concatenated, in the all-gather dtype:
the mixed-precision `param_dtype`, else the parameters' own) and `output_tensor` the n shards
rank-major (the input is a view of the output's own row). `ParameterAllGather`:

  1. quantises the shard in blocks into one message row, in one pass:
         [ nb fp32 scales | cols codes (uint8) | zero pad to a multiple of 4 bytes ]
     (scales first, so that every row's scales are 4-byte aligned in the gathered buffer);
  2. all-gathers the rows as uint8 (gloo refuses fp8 dtypes; NCCL takes bytes too);
  3. decodes every row, its own included, straight into `output_tensor` in its dtype, in one
     pass: all ranks end with bitwise the same parameters, and forward and backward gathers of
     the same shards give bitwise the same values (quantisation is deterministic).

The sharded parameters (what the optimizer updates) are never touched: only the gathered copy
is lossy, per element within `error_bound` (int8: absmax / 254 of its block; fp8: 2**-4
relative), plus one rounding to the output dtype. No error feedback: each step quantises the
current parameters afresh, so errors do not accumulate.

Bytes per call and rank: (n - 1) x `message_width(cols, block)`, vs (n - 1) x cols x 2 for bf16:
at block 256, int8 sends 0.508x the bf16 bytes (0.254x fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp_collectives import counters
from smp_collectives.formats import check_format, num_blocks
from smp_collectives.quantization import _use_triton, _workspace, dequantize_torch, quantize

# What the message decoder writes directly; other float dtypes (fp16) go through an fp32 copy.
_DIRECT_OUT = (torch.float32, torch.bfloat16)
_GATHERABLE = (torch.float32, torch.bfloat16, torch.float16)
_DECODE_SPAN = 2**16  # values per pass of the CPU int8 decoder: 256 KiB of fp32 scratch


def message_width(cols: int, block: int) -> int:
    """Bytes of one rank's message row for a shard of `cols` values: 4 per block, 1 per value,
    rounded up to a multiple of 4."""
    return 4 * num_blocks(cols, block) + -(-cols // 4) * 4


def gather_bytes(cols: int, n: int, block: int) -> int:
    """Bytes this rank sends in one quantised gather of `cols`-value shards over `n` ranks."""
    return (n - 1) * message_width(cols, block)


def _row_parts(message: torch.Tensor, cols: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols], scales fp32 [rows, nb]) as views of a message [rows, width]."""
    nb = num_blocks(cols, block)
    return message[:, 4 * nb : 4 * nb + cols], message[:, : 4 * nb].view(torch.float32)


def encode_shard(x: torch.Tensor, block: int, kind: str, message: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Quantise the flat shard `x` (fp32 / bf16 / fp16) into `message` (uint8 [width]); returns it."""
    cols = x.numel()
    codes, scales = _row_parts(message.view(1, -1), cols, block)
    quantize(x.reshape(1, cols), block, kind, impl=impl, out=codes, scale_out=scales)
    message[4 * num_blocks(cols, block) + cols :].zero_()
    return message


def decode_message(
    message: torch.Tensor, cols: int, block: int, kind: str, out: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """`out` [rows, cols] = every row of a gathered `message` [rows, width] decoded, scaled and
    rounded to `out`'s dtype (round to nearest even, as torch's own casts)."""
    rows = message.shape[0]
    out = out.view(rows, cols)
    if _use_triton(message, impl) and out.dtype in _DIRECT_OUT and out.is_contiguous():
        from smp_collectives import triton_kernels

        return triton_kernels.dequantize_message(message, cols, block, kind, out)
    codes, scales = _row_parts(message, cols, block)
    if kind == "int8":
        return _decode_int8(codes, scales, block, out)
    if out.dtype == torch.float32:
        return dequantize_torch(codes, scales, block, kind, out=out)
    values = _workspace(message.device, "parameter_gather.values", rows * cols).view(rows, cols)
    return out.copy_(dequantize_torch(codes, scales, block, kind, out=values))


def _decode_int8(codes: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """int8 rows into `out` (fp32 / bf16 / fp16): code -> fp32 (exact) into a cache-sized
    scratch, then one multiply by the block's scale written straight into `out`, rounded once
    to its dtype: the Triton kernel's operations, in two passes over a span that stays in
    cache (3x faster on CPU than decode, scale and cast as whole-buffer passes)."""
    rows, cols = out.shape
    span = max(block, _DECODE_SPAN)
    scratch = _workspace(out.device, "parameter_gather.decode", span)
    q = codes.view(torch.int8)
    for r in range(rows):
        for c0 in range(0, cols, span):
            c1 = min(cols, c0 + span)
            full = c0 + (c1 - c0) // block * block  # whole blocks, then the short last block
            values = scratch[: c1 - c0].copy_(q[r, c0:c1])
            b0 = c0 // block
            if full > c0:
                torch.mul(values[: full - c0].view(-1, block), scales[r, b0 : full // block, None],
                          out=out[r, c0:full].view(-1, block))
            if full < c1:
                torch.mul(values[full - c0 :], scales[r, full // block], out=out[r, full:c1])
    return out


def quantized_parameter_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, *,
    kind: str, block: int, impl: str = "auto", name: str | None = None,
) -> torch.Tensor:
    """All-gather `input` (this rank's flat shard) into `output` (n shards, rank-major) as
    block-quantised codes; see the module docstring."""
    if input.dtype not in _GATHERABLE or output.dtype not in _GATHERABLE:
        raise TypeError(
            f"quantised parameter all-gather takes fp32 / bf16 / fp16 shards, got {input.dtype} -> {output.dtype} "
            f"(parameters that already travel as 8-bit, e.g. float8 training's own all-gather, are not quantised again)"
        )
    n = dist.get_world_size(group)
    cols = input.numel()
    width = message_width(cols, block)
    send = _workspace(input.device, "parameter_gather.send", width, torch.uint8)
    recv = _workspace(input.device, "parameter_gather.recv", n * width, torch.uint8)
    encode_shard(input.reshape(-1), block, kind, send, impl=impl)
    dist.all_gather_into_tensor(recv, send, group=group)  # flat: gloo checks the sizes
    counters.record(name or f"param_gather.{kind}", (n - 1) * width)
    decode_message(recv.view(n, width), cols, block, kind, output, impl=impl)
    return output


class ParameterAllGather:
    """FSDP2 all-gather for a unit's parameters: `set_custom_all_gather(ParameterAllGather("int8"))`.

    kind: "int8" / "fp8" quantise (see the module docstring); None gathers exactly (counted).
    compress_ranks: quantise only gathers over groups of that many ranks (the unit's whole shard
    group); a gather over a smaller group is FSDP2's backward gather from the post-forward
    shards (`reshard_after_forward=<ranks>`, hpZ's in-node copy), which holds values already
    dequantised in forward: it goes exact, so backward sees the forward's parameters bitwise.
    """

    def __init__(self, kind: str | None, block: int = 256, impl: str = "auto", compress_ranks: int | None = None):
        if kind is not None:
            check_format(kind, block)
        self.kind, self.block, self.impl, self.compress_ranks = kind, block, impl, compress_ranks

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n = dist.get_world_size(group)
        if self.kind is None or (self.compress_ranks is not None and n != self.compress_ranks):
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            counters.record("param_gather.exact", (n - 1) * input_tensor.numel() * input_tensor.element_size())
        else:
            quantized_parameter_all_gather(
                output_tensor, input_tensor, group, kind=self.kind, block=self.block, impl=self.impl
            )
        return None  # done synchronously; FSDP waits on nothing
