"""apply_fsdp: FSDP2 (`fully_shard`) on each block, then on the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from smp.config import SMPConfig, canonical_dtype
from smp.tensor_parallel.styles import fsdp_shard_placement


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, canonical_dtype(name))


def mixed_precision_policy(config: SMPConfig) -> MixedPrecisionPolicy:
    mp = config.mixed_precision
    return MixedPrecisionPolicy(
        param_dtype=_dtype(mp.param_dtype),
        reduce_dtype=_dtype(mp.reduce_dtype),
        output_dtype=_dtype(mp.output_dtype),
        cast_forward_inputs=mp.cast_forward_inputs,
    )


def offload_policy(config: SMPConfig) -> OffloadPolicy:
    if not config.cpu_offload:
        return OffloadPolicy()
    # Pinned host memory makes host<->device copies async; it needs an accelerator to exist.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, config: SMPConfig, blocks: list[nn.Module]
) -> nn.Module:
    """Shard `blocks` one FSDP unit each, then the root (embeddings, head, the rest)."""
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(config), offload_policy=offload_policy(config),
                  shard_placement_fn=fsdp_shard_placement)  # packed TP weights shard on their other dim
    for block in blocks:
        fully_shard(block, reshard_after_forward=config.reshard_after_forward, **kwargs)
    # The root's parameters are needed again right at the start of backward (the LM head is
    # the last layer): keeping them gathered after forward saves one all-gather per step.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model
