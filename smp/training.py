"""Training-loop helpers that must know about sharding: gradient clipping and accumulation."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm across every shard and TP rank; returns the norm.

    Sharded (DTensor) gradients contribute their local part, summed over the mesh they are
    sharded on; replicated ones count once. Equal to `torch.nn.utils.clip_grad_norm_` on the
    unsharded model.
    """
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    # DTensor's norm reduces over its mesh (partial -> full); group per mesh/placement to batch.
    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    if math.isinf(norm_type):
        total = stacked.max()
    else:
        total = stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(clip_coef.to(g.device))
    return total


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
    """Average a scalar (e.g. the loss, for logging) over the data-parallel ranks."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return float(t)
