"""Expert parameters per rank, for `smp plan`: which modules hold a mixture-of-experts layer's
experts (the expert-parallel plan, as `smp.transform` resolves it), and what of them one rank
holds once the recipe has placed the model: its expert-parallel slice (E / ep experts of each
layer), FSDP-sharded over the data-parallel ranks left."""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.tensor import DTensor

from smp._compat import fsdp_sharded_data, own_parameters
from smp.config import SMPConfig
from smp.errors import ConfigError
from smp.expert_parallel import ExpertsModule, expand_ep_plan, resolve_ep_plan
from smp.planning.memory import fsdp_units


def find_experts(model: nn.Module, config: SMPConfig, ep: int) -> list[ExpertsModule]:
    """The experts modules of `model` (before transform) by the expert-parallel plan; [] for a
    dense model. At ep > 1 a plan that names nothing, or experts ep does not divide, raises the
    ConfigError `smp.transform` would raise."""
    plan = resolve_ep_plan(model, config.moe.plan)
    if ep > 1:
        return expand_ep_plan(model, plan, ep)
    if not plan.entries:
        return []
    try:
        return expand_ep_plan(model, plan, 1)
    except ConfigError:  # experts outside the contract train fine without EP; nothing to report
        return []


def expert_account(model: nn.Module, experts: list[ExpertsModule], ep: int, top_k: int) -> dict[str, int]:
    """Per-rank expert figures of a transformed model (`experts` from `find_experts` on it before
    transform): elements in the model, in this rank's ep slice (exactly 1/ep), on this rank after
    FSDP (read from the placed parameters), and the bytes FSDP allocates for them (padding
    included; part of the plan's parameter bytes)."""
    if not experts:
        return {}
    placed = {  # parameter -> (bytes FSDP allocates on this rank, ranks its unit shards over)
        id(fp.sharded_param): (fsdp_sharded_data(fp).numel() * fsdp_sharded_data(fp).element_size(),
                               fp.mesh_info.shard_mesh_size)
        for _, params in fsdp_units(model) for fp in params
    }
    total = ep_slice = local = nbytes = 0
    shard_size = 1
    for spec in experts:
        for name in spec.param_names:
            param = own_parameters(spec.module)[name]
            total += param.numel()
            # The ep rank owns E / ep whole experts of every [E, ...] parameter.
            ep_slice += spec.num_experts // ep * math.prod(param.shape[1:])
            local += (param.to_local() if isinstance(param, DTensor) else param).numel()
            param_bytes, shard_size = placed.get(id(param), (param.numel() * param.element_size(), 1))
            nbytes += param_bytes
    return {
        "moe_layers": len(experts), "num_experts": max(spec.num_experts for spec in experts), "top_k": top_k,
        "expert_parallel_degree": ep, "params_total": total, "params_ep_rank": ep_slice,
        "params_this_rank": local, "param_bytes_this_rank": nbytes, "fsdp_shard_size": shard_size,
    }
