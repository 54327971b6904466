"""Token dispatch: each token choice travels to the rank holding its expert and back.

One call per MoE layer and rank. The rank's router has picked `top_k` experts per token; the
(token, expert) choices are sorted by expert, which groups them by destination rank (rank r
holds experts [r*E_local, (r+1)*E_local)), sent by one all-to-all, run through the local
experts, and returned by a second all-to-all in the order they were sent. The routing weights
are applied on the token's own rank, so their gradient never travels. Both all-to-alls are
autograd-aware: backward runs them in reverse, so the gradient of each expert output goes back
to the rank that computed it and the gradient of each token to the rank that owns it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from smp._compat import all_to_all_autograd

# (hidden [n, h], local expert index [n, 1], weights [n, 1]) -> [n, h]: the experts module's
# own forward on this rank's slice of experts.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DispatchStats:
    """One layer's routing on one rank, for the last forward: token choices each local expert
    received (from every rank of the group), and this rank's choices dropped by the capacity."""

    tokens_per_expert: list[int]
    dropped: int
    sent_rows: int  # token choices this rank sent to other ranks (each way: out, then back)


def _exchange(t: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    return all_to_all_autograd(t, output_splits, input_splits, group)


def _capacity_keep(expert_sorted: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Mask over expert-sorted choices: the first `capacity` of each expert (in token order)."""
    counts = torch.bincount(expert_sorted, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(expert_sorted.numel(), device=expert_sorted.device) - starts[expert_sorted]
    return position < capacity


def dispatch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    local_experts: LocalExperts,
    num_experts: int,
    group: dist.ProcessGroup,
    capacity_factor: float | None = None,
) -> tuple[torch.Tensor, DispatchStats]:
    """sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden[t]) for this rank's tokens,
    with the experts spread over `group` (num_experts / group size on each rank)."""
    ep = dist.get_world_size(group)
    per_rank = num_experts // ep
    tokens, top_k = top_k_index.shape
    flat_expert = top_k_index.reshape(-1)
    expert_sorted, order = torch.sort(flat_expert, stable=True)  # grouped by expert, then token
    token_of = order // top_k
    weight_of = top_k_weights.reshape(-1)[order]
    dropped = 0
    if capacity_factor is not None:
        keep = _capacity_keep(expert_sorted, num_experts, math.ceil(capacity_factor * tokens * top_k / num_experts))
        dropped = int((~keep).sum())
        expert_sorted, token_of, weight_of = expert_sorted[keep], token_of[keep], weight_of[keep]

    # How many choices go to each expert, then to each rank; every rank learns what it receives.
    send_per_expert = torch.bincount(expert_sorted, minlength=num_experts)
    recv_per_expert = torch.empty_like(send_per_expert)
    dist.all_to_all_single(recv_per_expert, send_per_expert, group=group)  # [source rank, local expert]
    input_splits = send_per_expert.view(ep, per_rank).sum(1).tolist()
    recv_matrix = recv_per_expert.view(ep, per_rank)
    output_splits = recv_matrix.sum(1).tolist()

    received = _exchange(hidden[token_of], output_splits, input_splits, group)
    # Received rows come grouped by source rank, then expert: regroup them by local expert.
    local_expert = torch.repeat_interleave(
        torch.arange(per_rank, device=hidden.device).repeat(ep), recv_matrix.reshape(-1)
    )
    by_expert, regroup = torch.sort(local_expert, stable=True)
    ones = torch.ones(by_expert.numel(), 1, dtype=top_k_weights.dtype, device=hidden.device)
    computed = local_experts(received[regroup], by_expert.unsqueeze(1), ones)
    results = torch.empty_like(computed).index_copy(0, regroup, computed)  # back in received order
    returned = _exchange(results, input_splits, output_splits, group)

    out = torch.zeros_like(hidden)
    out = out.index_add(0, token_of, (returned * weight_of.unsqueeze(1)).to(hidden.dtype))
    rank = dist.get_rank(group)
    stats = DispatchStats(
        tokens_per_expert=recv_matrix.sum(0).tolist(), dropped=dropped,
        sent_rows=sum(input_splits) - input_splits[rank],
    )
    return out, stats
