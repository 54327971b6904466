"""What expert parallelism costs per rank: all-to-all bytes per step (for `smp plan` and
bench/bench_expert_parallel.py; the expert parameters a rank holds: smp/planning/experts.py)."""

from __future__ import annotations

from torch import nn

from smp.expert_parallel.apply import is_expert_parallel


def all_to_all_bytes_per_step(tokens: int, top_k: int, hidden: int, dtype_bytes: int, ep: int, moe_layers: int,
                              *, recompute: bool = False, grad_accum: int = 1) -> int:
    """Bytes one rank sends by all-to-all per optimizer step, with routing spread evenly.

    Each of a rank's `tokens` x `top_k` choices leaves the rank with probability (ep-1)/ep, as a
    `hidden`-wide row, twice per MoE layer forward (to its expert, and its result back) and twice
    in backward (the gradients, in reverse); recomputing the forward (activation checkpointing)
    sends the forward pair again."""
    passes = 2 + 2 + (2 if recompute else 0)
    return grad_accum * moe_layers * passes * tokens * top_k * hidden * dtype_bytes * (ep - 1) // ep


def planned_all_to_all_bytes(model: nn.Module, ep: int, tokens: int, hidden: int, dtype_bytes: int,
                             *, recompute: bool = False, grad_accum: int = 1) -> int:
    """`all_to_all_bytes_per_step` for a transformed model: its expert-parallel layers, and the
    top-k of its transformers config (`num_experts_per_tok`)."""
    moe_layers = sum(1 for m in model.modules() if is_expert_parallel(m))
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None) or 1
    return all_to_all_bytes_per_step(tokens, top_k, hidden, dtype_bytes, ep, moe_layers,
                                     recompute=recompute, grad_accum=grad_accum)
