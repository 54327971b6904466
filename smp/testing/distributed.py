"""Helpers the multi-rank test cases share: whole and local views of (D)Tensors, this rank's
rows of a global batch, the world mean of a per-rank value, and the gradient gap to a
single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import smp
from smp import _compat


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor is gathered (also fused-QKV layouts on torch 2.11, see
    `smp._compat.full_tensor`), a plain tensor is itself."""
    return _compat.full_tensor(t)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_rows(batch: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global batch, by data-parallel rank (a TP group shares it)."""
    per = batch.shape[0] // smp.state.dp_size
    return batch[smp.state.dp_rank * per:(smp.state.dp_rank + 1) * per]


def max_grad_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest |gradient - reference gradient| over all parameters, matched by name (the
    sharded model's gradients gathered whole)."""
    ref_params = dict(reference.named_parameters())
    return max(float((full_tensor(p.grad) - ref_params[n].grad).abs().max()) for n, p in model.named_parameters())


def world_mean(value: torch.Tensor) -> float:
    """Mean over all ranks of a per-rank scalar (e.g. the loss of its rows). TP ranks repeat
    their group's value, so with equal shares this is the data-parallel mean."""
    t = full_tensor(value.detach()).double().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
