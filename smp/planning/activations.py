"""Activation bytes per rank: the tensors autograd saves in one forward of the unsharded meta
model at the per-rank micro-batch, with fused attention standing in for SDPA and a shape-only
grouped matmul for MoE experts, then adjusted for activation checkpointing, offloading and
tensor parallel."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from smp._compat import view_base
from smp.config import SMPConfig
from smp.meta_ops import shape_only_grouped_mm


class _FusedAttention(torch.autograd.Function):
    """Stands in for scaled_dot_product_attention while counting: what a fused (flash /
    memory-efficient) kernel saves, q, k, v, output and the row log-sum-exp, and no seq x seq
    matrix (on the meta device SDPA would otherwise take the unfused math path)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _FusedAttention.apply(q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def saved_activation_bytes(model: nn.Module, micro_batch: int, seq_len: int, blocks: list[nn.Module],
                           compute_bytes: int | None, run: Callable[[], Any] | None = None) -> tuple[int, list[int]]:
    """(bytes autograd saves outside the blocks, bytes saved inside each block) for one
    forward of the (meta) model; parameters and their views are not activations. `run` replaces
    the causal LM's forward with labels (a pipeline stage's forward and loss)."""
    param_ids = {id(p) for p in model.parameters()}
    block_index: list[int | None] = [None]
    per_block = [0] * len(blocks)
    outside = [0]
    seen: list[torch.Tensor] = []  # keep the tensors alive so ids stay unique
    seen_ids: set[int] = set()

    def pack(t: torch.Tensor) -> Any:
        base = view_base(t)
        base = t if base is None else base
        if id(base) in param_ids or id(base) in seen_ids:
            return t
        seen_ids.add(id(base))
        seen.append(base)
        elem = base.element_size()
        if compute_bytes is not None and base.is_floating_point():
            elem = compute_bytes
        nbytes = base.numel() * elem
        if block_index[0] is None:
            outside[0] += nbytes
        else:
            per_block[block_index[0]] += nbytes
        return t

    def enter(i: int):
        def hook(*_: Any) -> None:
            block_index[0] = i
        return hook

    def leave(*_: Any) -> None:
        block_index[0] = None

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(leave))
    try:
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _fused_attention(), shape_only_grouped_mm():
            # use_cache=True: without a cache transformers inspects position ids for packed
            # sequences with a data-dependent branch, which meta tensors cannot take.
            out = run() if run is not None else model(input_ids=ids, labels=ids, use_cache=True)
        del out
    finally:
        for h in handles:
            h.remove()
    return outside[0], per_block


def activation_bytes(config: SMPConfig, outside: int, per_block: list[int], block_input: int,
                     tp: int) -> tuple[int, int, list[str]]:
    """(device bytes, host bytes, notes) of activations under checkpointing / offloading / TP,
    from what `saved_activation_bytes` counted without them."""
    notes = []
    ac = config.activation_checkpointing
    # Under tensor parallel each rank holds 1/tp of a block's head and MLP activations; the
    # norm and residual tensors are replicated unless sequence parallel splits them too.
    per_block = [b // tp for b in per_block] if tp > 1 else list(per_block)
    if tp > 1:
        notes.append("activations under tensor parallel: block activations divided by tp (approximate)")
    kept = []
    recompute_peak = 0
    for i, b in enumerate(per_block):
        if ac.mode == "full" and i % ac.every_n_layers == 0:
            kept.append(block_input)  # only the block's input survives until backward
            recompute_peak = max(recompute_peak, b)  # one block is rebuilt at a time
        else:
            kept.append(b)
    if ac.mode == "selective":
        notes.append("selective checkpointing: activations shown without it (an upper bound)")
    host = 0
    if config.activation_offloading:
        # Saved tensors of the blocks go to host; `activation_loading_horizon` blocks come back
        # ahead of backward.
        horizon = config.activation_loading_horizon
        on_device = sorted(kept, reverse=True)[:horizon]
        host = sum(kept) - sum(on_device)
        kept = on_device
    return outside + sum(kept) + recompute_peak, host, notes
