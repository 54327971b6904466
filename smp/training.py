"""Training-loop helpers that must know about sharding: gradient clipping and accumulation."""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from smp.mesh import device_type_for


@torch.no_grad()
def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm across every shard and TP rank; returns the norm.

    Sharded (DTensor) gradients contribute their local part, summed over the mesh dims they
    are sharded on; replicated ones count once; a pipelined model's stages are summed over the
    pipeline ranks (pass the model, not its parameters). Equal to
    `torch.nn.utils.clip_grad_norm_` on the unsharded model.
    """
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    # A pipelined model's tied tensor (embedding and head) has a copy on two pipeline ranks
    # holding one gradient: its norm counts one copy.
    skip = model_or_params.norm_skip() if hasattr(type(model_or_params), "norm_skip") else set()
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    norm_type = float(norm_type)
    is_max = math.isinf(norm_type)
    # One reduction per (mesh, placements) group instead of one collective per parameter:
    # each group's local sum of |g|^p (or max) is all-reduced over the mesh dims it is sharded on.
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    totals = []
    for g in counted:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            # A pending (partial) sum: norms of the parts are not the norm of the sum.
            totals.append(_reduce_local(torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).full_tensor(), norm_type))
        elif isinstance(g, DTensor):
            groups[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            groups[()].append(g)
    for key, tensors in groups.items():
        local = _reduce_local(torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in tensors]), norm_type)
        if key:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():  # Shard or _StridedShard (FSDP over TP)
                    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
                    dist.all_reduce(local, op=op, group=mesh.get_group(dim))
        totals.append(local)
    if not totals:  # every gradient of this rank is counted on another pipeline rank
        totals.append(torch.zeros((), device=grads[0].device))
    stacked = torch.stack([t.to(totals[0].device) for t in totals])
    local = stacked.max() if is_max else stacked.sum()
    # A pipelined model holds one slice of the layers per pipeline rank: add up the stages.
    pp_group = getattr(model_or_params, "pp_group", None)
    if pp_group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=pp_group)
    total = local if is_max else local.pow(1.0 / norm_type)
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(clip_coef.to(g.device))
    return total


def _reduce_local(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Combine per-tensor norms into max (inf-norm) or the sum of p-th powers."""
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward passes inside skip the reduce-scatter / all-reduce.

    Gradients stay unsharded and local until the first backward outside the context, which
    syncs the accumulated sum once. Costs one unsharded gradient copy of device memory.
    """
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def all_reduce_mean(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Average a scalar (e.g. the loss, for logging) over the ranks of `group` (default: all).

    The tensor lives where `group`'s backend runs collectives: an NCCL group has no CPU
    backend, so on the current CUDA device (the one smp.init set); else on the CPU.
    """
    device = device_type_for(dist.get_backend(group)) if dist.is_initialized() else "cpu"
    t = torch.as_tensor(value).detach().to(device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return float(t)
