"""Tokens routed to each expert of each MoE layer, per step (the step record's expert load)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp._compat import in_backward
from smp.expert_parallel.plan import expand_ep_plan, resolve_ep_plan


class ExpertLoadMeter:
    """Token choices routed to each expert of each MoE layer, per step, for the step record.

    Counts come from the `top_k_index` every experts module receives (the modules the model's
    expert-parallel plan names, or `plan`; docs/expert-parallel.md), with or without expert
    parallelism, summed over the training-mode forwards since the last `record` (micro-batches
    included; evaluation in eval mode is not counted). A forward recomputed in backward by
    activation checkpointing is not counted again. A model without MoE layers records nothing."""

    def __init__(self, model: nn.Module, plan: dict[str, str] | None = None) -> None:
        ep_plan = resolve_ep_plan(model, plan)
        self.layers = expand_ep_plan(model, ep_plan, 1) if ep_plan.entries else []
        self._counts: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, spec in enumerate(self.layers):
            spec.module.register_forward_pre_hook(self._counter(i, spec.num_experts), with_kwargs=True)

    def _counter(self, layer: int, num_experts: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # Evaluation (module.eval()) is not training; inside backward a forward is a
            # checkpointing recompute of one already counted.
            if not module.training or in_backward():
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts = torch.bincount(index.reshape(-1), minlength=num_experts)  # stays on the device
            seen = self._counts[layer]
            self._counts[layer] = counts if seen is None else seen + counts

        return count

    def record(self, group: dist.ProcessGroup | None = None, copies: int = 1) -> dict[str, Any]:
        """This step's figures, then start counting the next step's:

        - `tokens_per_expert`: per MoE layer (module order), the token choices routed to each
          expert, summed over the ranks of `group` (None: this rank) and divided by `copies`, the
          number of its ranks that see the same tokens (tensor-parallel ranks);
        - `expert_load_max_over_mean`: the busiest expert's count over the mean count, in the
          least balanced layer (1.0: perfectly even; under expert parallelism the rank holding
          that expert sets the layer's pace). None when no token was routed.

        Every rank of `group` must call it (one all-reduce)."""
        if not self.layers:
            return {}
        sizes = [spec.num_experts for spec in self.layers]
        device = next((c.device for c in self._counts if c is not None), torch.device("cpu"))
        counts = torch.cat([c if c is not None else torch.zeros(n, dtype=torch.long, device=device)
                            for c, n in zip(self._counts, sizes)])
        self._counts = [None] * len(self.layers)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        per_layer = [part.tolist() for part in (counts // copies).split(sizes)]
        balance = [max(row) * len(row) / sum(row) for row in per_layer if sum(row)]
        return {"tokens_per_expert": per_layer, "expert_load_max_over_mean": max(balance) if balance else None}
