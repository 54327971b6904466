"""apply_fsdp: FSDP2 (`fully_shard`) on each block, then on the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from smp.config import canonical_dtype
from smp.sharding.batch_norm import refuse_batch_statistics
from smp.sharding.scalars import average_scalar_gradients, scalar_parameters
from smp.tensor_parallel.styles import fsdp_shard_placement
from smp.vision.mixed_batches import install_image_path_on_every_rank


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a config spells `name` ("bf16", "float32", ...); None stays None."""
    return None if name is None else getattr(torch, canonical_dtype(name))


def offload_policy(cpu_offload: bool) -> OffloadPolicy:
    if not cpu_offload:
        return OffloadPolicy()
    # Pinned host memory makes host<->device copies async; it needs an accelerator to exist.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def fsdp_needed(
    shard_ranks: int, *, param_dtype: torch.dtype | None, output_dtype: torch.dtype | None,
    cpu_offload: bool, custom_sync: bool,
) -> bool:
    """Whether FSDP has work to do. Over one rank (tensor parallel taking the whole world) it
    shards nothing and reduces nothing (so its reduce dtype means nothing), and only adds copies
    to each step: smp skips it, as torchtitan does, unless one of FSDP's other jobs is asked for:
    casting parameters or outputs (mixed precision), CPU offload, or smp's own gradient-sync
    collectives (installed on FSDP units)."""
    if shard_ranks > 1:
        return True
    return param_dtype is not None or output_dtype is not None or cpu_offload or custom_sync


def block_reshard_after_forward(configured: bool | int, *, explicit: bool, shard_ranks: int, cpu_offload: bool) -> bool | int:
    """The blocks' `reshard_after_forward`: as configured, except that left unset it is False
    where each block is sharded over one rank. Resharding there frees only the block's
    low-precision copy, which the same step in plain PyTorch keeps too (autocast saves its casts
    for backward), and costs a cast and an all-gather per block in backward: 3% of a 1B Llama's
    step on an H100 (docs/gpu-check.md)."""
    if explicit or shard_ranks > 1 or cpu_offload:
        return configured
    return False


def settle_partial_grads(model: nn.Module) -> None:
    """Without FSDP, give each DTensor parameter's gradient the parameter's own placements right
    after backward accumulates it, as FSDP does before it reduces. A replicated weight applied to
    sequence shards (sequence-parallel norms) gets a pending-sum (Partial) gradient; left so,
    every optimizer op that reads it would all-reduce it again."""
    def settle(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(placements=param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(settle)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: list[nn.Module],
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard `blocks` one FSDP unit each, then the root (embeddings, head, the rest), over `mesh`.

    The dtypes and `cast_forward_inputs` make FSDP2's MixedPrecisionPolicy (None keeps a
    parameter's own dtype); `reshard_after_forward` applies to the blocks; `cpu_offload` keeps
    parameters, gradients and optimizer state in host memory.
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype,
        cast_forward_inputs=cast_forward_inputs,
    )
    # 0-d parameters (CLIP's logit_scale), which fully_shard refuses: whole on every rank,
    # gradient averaged after backward (smp/sharding/scalars.py).
    scalars = scalar_parameters(model)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy(cpu_offload),
                  shard_placement_fn=fsdp_shard_placement,  # packed TP weights shard on their other dim
                  ignored_params=scalars or None)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters are needed again right at the start of backward (the LM head is
    # the last layer): keeping them gathered after forward saves one all-gather per step.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    average_scalar_gradients(scalars, mesh)
    # A VLM's vision-tower units run on every rank, also where a batch holds no image
    # (smp/vision/mixed_batches.py): otherwise they all-gather on some ranks only.
    install_image_path_on_every_rank(model, [mesh.get_group(i) for i in range(mesh.ndim)] if mesh.size() > 1 else [])
    # BatchNorm in training mode would normalise each rank's rows alone (smp/sharding/batch_norm.py).
    refuse_batch_statistics(model, mesh.size())
    return model
