"""Ring attention: each rank keeps its queries; key/value blocks travel around the cp ring.

Forward, step s (0..cp-1): rank r holds the block of rank r - s. It starts sending that block to
rank r + 1 (and receiving the next one from r - 1), attends its queries to the block in hand while
the transfer runs, and merges the partial output by its log-sum-exp (exact).

Backward rings too: the block travels the same way with two accumulators, its dK and dV. Each
rank adds its queries' contribution (computed from the merged output and lse, so exact) and
passes block and accumulators on; after cp steps every block is home with its full gradient.
Memory: the saved tensors are this rank's q, k, v, output and lse only (no score matrices).

Bytes per rank per attention call, forward: (cp - 1) x (K + V + key mask of one block);
backward: (cp - 1) x (K + V + mask + dK + dV, fp32) + one more dK + dV (the trip home).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smp.context_parallel.blocks import Segments, block_backward, block_forward, merge, pack, unpack


def _exchange(buffer: torch.Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int) -> tuple[torch.Tensor, list]:
    """Start sending `buffer` to `send_to` and receiving one of its size from `recv_from`
    (global ranks); returns the receive buffer and the requests to wait on."""
    incoming = torch.empty_like(buffer)
    ops = [dist.P2POp(dist.isend, buffer, send_to, group), dist.P2POp(dist.irecv, incoming, recv_from, group)]
    return incoming, dist.batch_isend_irecv(ops)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                q_docs: torch.Tensor, group: dist.ProcessGroup, segments: list[Segments], causal: bool,
                window: int | None, scale: float) -> torch.Tensor:
        """q (B, Hkv, G, Lq, D), k/v (B, Hkv, Lk, D) float32; keep (B, Lk) / q_docs (B, Lq) the
        keys' / queries' document keys (blocks.py, NaN: padding); `segments[i]`: the global runs
        rank i of `group` holds. Returns the output (B, Hkv, G, Lq, D)."""
        size, rank = len(segments), dist.get_rank(group)
        send_to = dist.get_global_rank(group, (rank + 1) % size)
        recv_from = dist.get_global_rank(group, (rank - 1) % size)
        out = lse = None
        held = pack(k, v, keep)
        for step in range(size):
            pending = _exchange(held, group, send_to, recv_from) if step < size - 1 else None
            k_blk, v_blk, keep_blk = unpack(held, [k, v, keep])
            part_out, part_lse = block_forward(
                q, k_blk, v_blk, keep_blk, segments[rank], segments[(rank - step) % size],
                q_docs=q_docs, causal=causal, window=window, scale=scale,
            )
            out, lse = (part_out, part_lse) if out is None else merge(out, lse, part_out, part_lse)
            if pending is not None:
                held, requests = pending
                for request in requests:
                    request.wait()
        ctx.save_for_backward(q, k, v, keep, q_docs, out, lse)
        ctx.group, ctx.segments, ctx.causal, ctx.window, ctx.scale = group, segments, causal, window, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, keep, q_docs, out, lse = ctx.saved_tensors
        group, segments = ctx.group, ctx.segments
        size, rank = len(segments), dist.get_rank(group)
        send_to = dist.get_global_rank(group, (rank + 1) % size)
        recv_from = dist.get_global_rank(group, (rank - 1) % size)
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)
        dq = torch.zeros_like(q)
        k_blk, v_blk, keep_blk = k, v, keep
        dk_acc, dv_acc = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(size):
            dq_part, dk_part, dv_part = block_backward(
                q, k_blk, v_blk, keep_blk, out, lse, grad_out, delta,
                segments[rank], segments[(rank - step) % size],
                q_docs=q_docs, causal=ctx.causal, window=ctx.window, scale=ctx.scale,
            )
            dq += dq_part
            dk_acc, dv_acc = dk_acc + dk_part, dv_acc + dv_part
            # Pass the block on with its accumulators; the last hop takes only the gradients home.
            last = step == size - 1
            message = pack(dk_acc, dv_acc) if last else pack(k_blk, v_blk, keep_blk, dk_acc, dv_acc)
            incoming, requests = _exchange(message, group, send_to, recv_from)
            for request in requests:
                request.wait()
            if last:
                dk_acc, dv_acc = unpack(incoming, [k, v])
            else:
                k_blk, v_blk, keep_blk, dk_acc, dv_acc = unpack(incoming, [k, v, keep, k, v])
        return dq, dk_acc, dv_acc, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                   group: dist.ProcessGroup, segments: list[Segments], *, q_docs: torch.Tensor, causal: bool,
                   window: int | None, scale: float) -> torch.Tensor:
    return RingAttention.apply(q, k, v, keep, q_docs, group, segments, causal, window, scale)
