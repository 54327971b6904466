"""All-gather attention: gather every rank's key/value block once, attend the local queries.

One collective instead of cp - 1 ring steps: fewer, larger messages (better on high-latency
links, small cp, or GQA models whose K/V are small), but the whole sequence's K/V sits on every
rank during the call and the transfer is not overlapped with compute. Backward gathers K/V again
(only the local block is saved, as FSDP reshards parameters) and reduce-scatters dK/dV home.

Bytes per rank per attention call, forward: (cp - 1)/cp x cp blocks of (K + V + key mask);
backward: the same gather again plus a reduce-scatter of dK + dV (fp32) over the cp blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smp.context_parallel.blocks import Segments, block_backward, block_forward, merge, pack, unpack


def _gather(buffer: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    gathered = buffer.new_empty(size * buffer.numel())
    dist.all_gather_into_tensor(gathered, buffer, group=group)
    return gathered.view(size, -1)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                q_docs: torch.Tensor, group: dist.ProcessGroup, segments: list[Segments], causal: bool,
                window: int | None, scale: float) -> torch.Tensor:
        """Same arguments and result as `RingAttention.forward`."""
        size, rank = len(segments), dist.get_rank(group)
        blocks = _gather(pack(k, v, keep), group, size)
        out = lse = None
        for source in range(size):
            k_blk, v_blk, keep_blk = unpack(blocks[source], [k, v, keep])
            part_out, part_lse = block_forward(
                q, k_blk, v_blk, keep_blk, segments[rank], segments[source],
                q_docs=q_docs, causal=causal, window=window, scale=scale,
            )
            out, lse = (part_out, part_lse) if out is None else merge(out, lse, part_out, part_lse)
        ctx.save_for_backward(q, k, v, keep, q_docs, out, lse)
        ctx.group, ctx.segments, ctx.causal, ctx.window, ctx.scale = group, segments, causal, window, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, keep, q_docs, out, lse = ctx.saved_tensors
        group, segments = ctx.group, ctx.segments
        size, rank = len(segments), dist.get_rank(group)
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)
        blocks = _gather(pack(k, v, keep), group, size)
        dq = torch.zeros_like(q)
        grads = []
        for source in range(size):
            k_blk, v_blk, keep_blk = unpack(blocks[source], [k, v, keep])
            dq_part, dk_part, dv_part = block_backward(
                q, k_blk, v_blk, keep_blk, out, lse, grad_out, delta,
                segments[rank], segments[source], q_docs=q_docs, causal=ctx.causal, window=ctx.window, scale=ctx.scale,
            )
            dq += dq_part
            grads.append(pack(dk_part, dv_part))
        mine = torch.empty_like(grads[0])
        dist.reduce_scatter_tensor(mine, torch.cat(grads), group=group)  # sum over the cp ranks
        dk, dv = unpack(mine, [k, v])
        return dq, dk, dv, None, None, None, None, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                        group: dist.ProcessGroup, segments: list[Segments], *, q_docs: torch.Tensor, causal: bool,
                        window: int | None, scale: float) -> torch.Tensor:
    return AllGatherAttention.apply(q, k, v, keep, q_docs, group, segments, causal, window, scale)
