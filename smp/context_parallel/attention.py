"""`smp.context_parallel.attention(q, k, v, causal=True)`: attention that sees the whole sequence
while each cp rank holds only its chunks of it.

`apply_context_parallel` (smp.transform) activates it for the session (smp/scope.py), so that
`smp.shutdown`, which destroys its process group, forgets it too.
Without an active setup (cp = 1, or a model that was not transformed) it is plain local attention,
so a model that calls it runs unchanged in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp.context_parallel.allgather import allgather_attention
from smp.context_parallel.ring import ring_attention
from smp.context_parallel.sharding import chunk_positions, chunk_segments, document_keys
from smp.context_parallel.ulysses import check_heads, ulysses_attention
from smp.scope import Slot

ALGORITHMS = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


@dataclass
class ContextParallelSetup:
    group: dist.ProcessGroup
    rank: int
    size: int
    algorithm: str
    load_balance: bool
    calls: int = field(default=0)  # attention calls in the current forward (the model check)
    probing: bool = field(default=False)  # the meta-device probe runs (smp/context_parallel/probe.py)


_SETUP: Slot[ContextParallelSetup] = Slot("context parallel setup")


def activate(setup: ContextParallelSetup) -> None:
    _SETUP.set(setup)


def deactivate() -> None:
    """Forget the setup (its process group is about to go). smp.shutdown forgets it with the
    session; `smp plan`, which runs outside one, calls this."""
    _SETUP.clear()


def active() -> ContextParallelSetup | None:
    return _SETUP.peek()


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool = True,
              scale: float | None = None, sliding_window: int | None = None,
              key_padding_mask: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention over the whole sequence: query (B, H, L, D), key/value
    (B, Hkv, L, D) with H a multiple of Hkv (GQA), L this rank's tokens; `key_padding_mask`
    (B, L), True/1 = a real token; `sliding_window` w keeps keys with index > query index - w;
    `position_ids` (B, L), this rank's tokens' positions: packed rows (positions restarting at 0
    at each document) attend within each document only. Masks follow global token indices.
    Returns (B, H, L, D) in the query's dtype."""
    b, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads is not a multiple of {kv_heads} key/value heads")
    scale = dim ** -0.5 if scale is None else scale
    if position_ids is not None and position_ids.dim() != 2:
        position_ids = None  # multimodal (3-D) positions: one document per row
    setup = _SETUP.peek()
    if setup is None:
        return _local_attention(query, key, value, causal, scale, sliding_window, key_padding_mask, position_ids)
    setup.calls += 1
    if setup.algorithm == "ulysses":  # before the probe returns: refused before any collective
        check_heads(heads, kv_heads, setup.size)
    if setup.probing:  # meta tensors, nothing to communicate: the probe needs the call and the shape
        return query.new_empty(b, heads, length, value.shape[-1])
    seq_len = length * setup.size
    segments = [chunk_segments(seq_len, setup.size, r, setup.load_balance) for r in range(setup.size)]
    index = chunk_positions(seq_len, setup.size, setup.rank, setup.load_balance, device=query.device)
    q_docs = document_keys(position_ids, index, b)
    keep = _key_documents(q_docs, key_padding_mask)
    q = query.float().reshape(b, kv_heads, heads // kv_heads, length, dim)
    out = ALGORITHMS[setup.algorithm](
        q, key.float(), value.float(), keep, setup.group, segments,
        q_docs=q_docs, causal=causal, window=sliding_window, scale=scale,
    )
    return out.reshape(b, heads, length, -1).to(query.dtype)


def _key_documents(q_docs: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Each key's document key (B, L) float, NaN where padding (equal to no query's)."""
    if key_padding_mask is None:
        return q_docs
    return q_docs.masked_fill(~key_padding_mask.to(torch.bool), float("nan"))


def _local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                     scale: float, window: int | None, key_padding_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    if window is None and key_padding_mask is None and position_ids is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=gqa)
    length = query.shape[2]
    index = torch.arange(length, device=query.device)
    allowed = torch.ones(length, length, dtype=torch.bool, device=query.device)
    if causal:
        allowed = allowed & (index[None, :] <= index[:, None])
    if window is not None:
        allowed = allowed & (index[None, :] > index[:, None] - window)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(torch.bool)[:, None, None, :]
    if position_ids is not None:
        docs = document_keys(position_ids, index, query.shape[0])
        allowed = allowed & (docs[:, None, None, :] == docs[:, None, :, None])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)
