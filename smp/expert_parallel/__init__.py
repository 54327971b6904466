"""Expert parallelism: each MoE layer's experts split over the "ep" ranks, tokens dispatched by
all-to-all (docs/expert-parallel.md).

`plan.py` says where the plan comes from and which modules it names, `dispatch.py` moves the
tokens, `apply.py` splits the experts and makes them FSDP units, `load_balancing.py` makes the
model's own auxiliary loss global over the data-parallel ranks. `smp.transform` calls them when
expert_parallel_degree > 1.
"""

from __future__ import annotations

from smp.config import MoEConfig
from smp.expert_parallel.apply import apply_expert_parallel, expert_load, is_expert_parallel, shard_experts
from smp.expert_parallel.dispatch import DispatchStats
from smp.expert_parallel.load_balancing import apply_load_balancing, global_load_balancing_loss
from smp.expert_parallel.plan import SMP_TABLES, EPPlan, ExpertsModule, expand_ep_plan, resolve_ep_plan

__all__ = [
    "SMP_TABLES", "DispatchStats", "EPPlan", "ExpertsModule", "MoEConfig", "apply_expert_parallel",
    "apply_load_balancing", "expand_ep_plan", "expert_load", "global_load_balancing_loss",
    "is_expert_parallel", "resolve_ep_plan", "shard_experts",
]
