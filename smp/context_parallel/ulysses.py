"""Ulysses attention (all-to-all over heads, DeepSpeed-Ulysses): each cp rank trades its chunks
of every head for the whole sequence of heads/cp of the heads, attends those heads over the whole
sequence locally, and trades the output back.

Four all-to-alls per call in forward (q, k, v in, output back; their gradients in backward),
each moving (cp - 1)/cp of a rank's tensor, plus one small all-gather of the key padding and
document keys. Unlike the ring, the bytes per rank do not grow with cp at a fixed sequence
length per rank, but the key/value heads must divide by cp (by cp x tp under tensor parallel,
which has already split them by tp): refused otherwise, naming the counts.

Shapes as ring.py: q (B, Hkv, G, L, D), k/v (B, Hkv, L, D) float32, keep / q_docs (B, L).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp._compat import all_to_all_autograd
from smp.context_parallel.blocks import Segments, attend
from smp.errors import UsageError


def check_heads(heads: int, kv_heads: int, cp: int, tp: int = 1) -> None:
    """Raise UsageError unless Ulysses can split the (query and key/value) heads over cp."""
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % (cp * tp):
            over = f"context_parallel_degree x tensor_parallel_degree = {cp} x {tp}" if tp > 1 else (
                f"context_parallel_degree = {cp}")
            raise UsageError(
                f"context_parallel.algorithm: ulysses splits the heads over the cp ranks, but the "
                f"model's {count} {name} do not divide by {over}; use algorithm ring or allgather, "
                f"or a context_parallel_degree that divides {count // tp if tp > 1 else count}"
            )


def _gathered_order(segments: list[Segments], device: torch.device) -> torch.Tensor:
    """Global token index of each gathered token, in arrival order (rank 0's chunks first)."""
    return torch.cat([torch.arange(s, s + n, device=device) for runs in segments for s, n in runs])


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """(B, H, ..., L, D) this rank's tokens of every head -> (size, B, H/size, ..., L, D): every
    rank's tokens (arrival order) of this rank's heads. Differentiable."""
    send = torch.stack(x.chunk(size, dim=1))  # head group r goes to rank r
    out = all_to_all_autograd(send, [1] * size, [1] * size, group)
    return out.view(send.shape)


def heads_home(parts: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The reverse: (size, B, H/size, ..., L, D), part r holding rank r's tokens of this rank's
    heads -> (B, H, ..., L, D) this rank's tokens of every head, head groups in rank order."""
    back = all_to_all_autograd(parts.contiguous(), [1] * size, [1] * size, group).view(parts.shape)
    return torch.cat(back.unbind(0), dim=1)


def _whole(parts: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(size, ..., L, D) arrival-ordered parts -> (..., size x L, D) in global token order."""
    whole = torch.cat(parts.unbind(0), dim=-2)
    return whole.index_select(-2, torch.argsort(order))


def _split(whole: torch.Tensor, order: torch.Tensor, size: int) -> torch.Tensor:
    """(..., S, D) global order -> (size, ..., S/size, D), part r the tokens rank r holds."""
    return torch.stack(whole.index_select(-2, order).chunk(size, dim=-2))


def _gather_tokens(t: torch.Tensor, order: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """All-gather of small per-token tensors (no gradient): (..., L) -> (..., S) global order."""
    parts = t.new_empty((size * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(parts, t.contiguous(), group=group)
    parts = parts.view(size, *t.shape)
    return torch.cat(parts.unbind(0), dim=-1).index_select(-1, torch.argsort(order))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                      group: dist.ProcessGroup, segments: list[Segments], *, q_docs: torch.Tensor,
                      causal: bool, window: int | None, scale: float) -> torch.Tensor:
    size = len(segments)
    heads, kv_heads = q.shape[1] * q.shape[2], k.shape[1]
    check_heads(heads, kv_heads, size)
    order = _gathered_order(segments, q.device)
    masks = _gather_tokens(torch.stack([keep, q_docs]), order, group, size)  # (2, B, S)
    q_all, k_all, v_all = (_whole(sequence_to_heads(t, group, size), order) for t in (q, k, v))
    out = attend(q_all, k_all, v_all, masks[0], masks[1], causal=causal, window=window, scale=scale)
    return heads_home(_split(out, order, size), group, size)
