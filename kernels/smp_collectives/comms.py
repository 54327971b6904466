"""Collectives packaged for FSDP2's custom-comm seams, and the compressed ones.

FSDP2 (`torch.distributed.fsdp.fully_shard`) accepts per module:
  * `set_custom_reduce_scatter(comm)`: comm(output_tensor=, input_tensor=, group=, op=) with a
    1-D rank-major input in reduce dtype, written synchronously into `output_tensor`;
  * `set_custom_all_gather(comm)`: comm(output_tensor=, input_tensor=, group=, async_op=);
  * `set_all_reduce_hook(hook)`: hook(reduce_output) after the reduce-scatter (1-D FSDP), in place.
Each comm also has `allocate(size, *, dtype, device)`. The classes here follow that protocol
(duck-typed, so no private torch import), and work on their own on any tensors and groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp_collectives import counters, ring
from smp_collectives.error_feedback import Residual
from smp_collectives.formats import check_format, num_blocks
from smp_collectives.quantization import _workspace, dequantize, dequantize_accumulate, quantize


class _Alloc:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class RingReduceScatter(_Alloc):
    def __call__(self, output_tensor, input_tensor, group, op=dist.ReduceOp.SUM, async_op=False):
        ring.reduce_scatter(output_tensor, input_tensor, group, op)


class RingAllGather(_Alloc):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ring.all_gather(output_tensor, input_tensor, group)
        return None  # done synchronously; FSDP waits on nothing


# ------------------------------------------------------------------------------------------
# Block-quantised exchange


def _unpack(buf: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[:, :cols], buf[:, cols:].contiguous().view(torch.float32)


def _op_divisor(op, n: int) -> float:
    if op == dist.ReduceOp.AVG:
        return float(n)
    if op == dist.ReduceOp.SUM:
        return 1.0
    raise ValueError(f"quantized reduce_scatter supports SUM and AVG, not {op}")


def quantized_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, op, *,
    kind: str, block: int, residual: torch.Tensor | None = None, impl: str = "auto",
    name: str | None = None,
) -> torch.Tensor:
    """Reduce-scatter at ~1/4 of the fp32 bytes.

    Quantise each destination chunk in blocks (fp32 scale per block, error feedback into
    `residual` [N, C] if given), one all-to-all of codes+scales, then dequantise and accumulate
    the N incoming chunks in fp32 (fixed rank order) and divide for AVG.
    """
    n = dist.get_world_size(group)
    chunks = input.reshape(n, -1)
    cols = chunks.shape[1]
    # Row r of the message to rank r: its chunk's codes, then their scales. Both message
    # buffers are reused across calls (see `_workspace`): on CPU, fresh bucket-sized buffers
    # cost more in page faults than the quantisation itself.
    width = cols + 4 * num_blocks(cols, block)
    send = _workspace(input.device, "reduce_scatter.send", n * width, torch.uint8).view(n, width)
    recv = _workspace(input.device, "reduce_scatter.recv", n * width, torch.uint8).view(n, width)
    _, scale = quantize(chunks, block, kind, residual, impl=impl, out=send[:, :cols])
    send[:, cols:].copy_(scale.view(torch.uint8))
    dist.all_to_all_single(recv, send, group=group)
    counters.record(name or f"{kind}.reduce_scatter", (n - 1) * width)
    rq, rs = _unpack(recv, cols)
    divisor = _op_divisor(op, n)
    if output.is_contiguous() and output.dtype == torch.float32:
        dequantize_accumulate(rq, rs, block, kind, divisor, impl=impl, out=output.view(-1))
    else:
        output.copy_(dequantize_accumulate(rq, rs, block, kind, divisor, impl=impl).view_as(output))
    return output


def quantized_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, *,
    kind: str, block: int, residual: torch.Tensor | None = None, impl: str = "auto",
    name: str | None = None,
) -> torch.Tensor:
    """All-gather of quantised chunks; every rank (the sender included) keeps the dequantised
    values, so all ranks end with bitwise identical data."""
    n = dist.get_world_size(group)
    cols = input.numel()
    width = cols + 4 * num_blocks(cols, block)
    send = _workspace(input.device, "all_gather.send", width, torch.uint8).view(1, width)
    recv = _workspace(input.device, "all_gather.recv", n * width, torch.uint8).view(n, width)
    _, scale = quantize(input.reshape(1, cols), block, kind, residual, impl=impl, out=send[:, :cols])
    send[:, cols:].copy_(scale.view(torch.uint8))
    dist.all_gather_into_tensor(recv, send, group=group)
    counters.record(name or f"{kind}.all_gather", (n - 1) * width)
    rq, rs = _unpack(recv, cols)
    if output.is_contiguous() and output.dtype == torch.float32:
        dequantize(rq, rs, block, kind, impl=impl, out=output.view(n, cols))
    else:
        output.view(n, cols).copy_(dequantize(rq, rs, block, kind, impl=impl))
    return output


class QuantizedReduceScatter(_Alloc):
    """FSDP2 reduce-scatter that sends int8 / fp8 codes; one instance per FSDP module."""

    def __init__(self, kind: str, block: int = 256, error_feedback: bool = True, impl: str = "auto"):
        check_format(kind, block)
        self.kind, self.block, self.impl = kind, block, impl
        self.residual = Residual() if error_feedback else None

    def __call__(self, output_tensor, input_tensor, group, op=dist.ReduceOp.SUM, async_op=False):
        n = dist.get_world_size(group)
        res = self.residual.get((n, input_tensor.numel() // n), input_tensor.device) if self.residual else None
        quantized_reduce_scatter(
            output_tensor, input_tensor, group, op, kind=self.kind, block=self.block, residual=res, impl=self.impl
        )


class CrossReplicaAllReduce:
    """An FSDP2 all-reduce hook: average the (already shard-reduced) gradient across replicas.

    With 1-D FSDP inside each replica group and this hook across groups, only this hop (the
    inter-node one in a hybrid layout) is compressed. `kind=None` sends it uncompressed over
    the ring, which equals native HSDP; "int8"/"fp8" quantise both halves of the all-reduce
    (reduce-scatter by all-to-all, then all-gather), each with its own error-feedback residual.
    """

    def __init__(self, group: dist.ProcessGroup, kind: str | None = None, block: int = 256,
                 error_feedback: bool = True, impl: str = "auto"):
        if kind is not None:
            check_format(kind, block)
        self.group, self.kind, self.block, self.impl = group, kind, block, impl
        self.residuals = (Residual(), Residual()) if (error_feedback and kind) else None

    def __call__(self, grad: torch.Tensor) -> None:
        n = dist.get_world_size(self.group)
        if n == 1:
            return
        if self.kind is None:
            ring.all_reduce(grad, self.group, dist.ReduceOp.AVG, name="cross_replica.ring")
            return
        flat = grad.reshape(-1)
        cols = -(-flat.numel() // n)
        padded = _workspace(grad.device, "cross_replica.padded", n * cols)
        padded[: flat.numel()].copy_(flat)
        padded[flat.numel() :].zero_()
        res1 = self.residuals[0].get((n, cols), grad.device) if self.residuals else None
        res2 = self.residuals[1].get((1, cols), grad.device) if self.residuals else None
        mine = _workspace(grad.device, "cross_replica.mine", cols)
        name = f"cross_replica.{self.kind}"
        quantized_reduce_scatter(mine, padded, self.group, dist.ReduceOp.AVG, kind=self.kind,
                                 block=self.block, residual=res1, impl=self.impl, name=name + ".reduce_scatter")
        quantized_all_gather(padded, mine, self.group, kind=self.kind, block=self.block,
                             residual=res2, impl=self.impl, name=name + ".all_gather")
        grad.copy_(padded[: flat.numel()].view_as(grad))


def fp32_bytes_bound(numel: int, n: int, element_size: int = 4) -> int:
    """(N-1)/N x S: what a bandwidth-optimal uncompressed reduce-scatter sends per rank."""
    return (n - 1) * (numel // n) * element_size


def quantized_bytes(numel: int, n: int, block: int) -> int:
    """Bytes per rank of `quantized_reduce_scatter`: codes + 4-byte scales for N-1 chunks."""
    cols = numel // n
    return (n - 1) * (cols + 4 * num_blocks(cols, block))
