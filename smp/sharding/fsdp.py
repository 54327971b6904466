"""apply_fsdp: FSDP2 (`fully_shard`) on the blocks (alone, or merged into units of at least
MIN_UNIT_BYTES), then on the root; over a one-rank shard group, smp's own mixed precision instead
(smp/sharding/cast_params.py). `unit_layout` says which; `describe_layout` says it in words."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from smp._compat import dtensor_local
from smp.config import canonical_dtype
from smp.sharding.cast_params import CastParameters
from smp.sharding.scalars import average_scalar_gradients, scalar_parameters
from smp.tensor_parallel.styles import fsdp_shard_placement


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
    """Whether `apply_fsdp` has work to do. Over one rank (tensor parallel taking the whole world)
    FSDP shards nothing and reduces nothing (so its reduce dtype means nothing), and only adds
    copies to each step: smp skips it, as torchtitan does, unless one of FSDP's other jobs is
    asked for: casting parameters or outputs (mixed precision: `apply_fsdp` then casts without
    FSDP units where that is exact, `unit_layout`), CPU offload, or smp's own gradient-sync
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


# FSDP2 costs about a thousand Python calls per unit per step (hooks, per-parameter copies,
# DTensor wrapping), whatever the unit's size: on a fast GPU a unit much smaller than this is
# host-bound (pytorch#173680: pre_forward is half the step). Consecutive blocks are merged into one
# unit until it holds at least this many bytes of (unsharded) parameters. The trade: a merged unit
# is gathered whole, so with resharding up to two units' worth (the one computing and the one
# prefetched) of gathered parameters are alive at once; lower it when that is too much memory,
# raise it when the host still shows (smp plan prints the layout). 0 keeps one unit per block.
MIN_UNIT_BYTES = 64 * 2**20


def unit_layout(
    model: nn.Module, shard_ranks: int, *, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool | int, cpu_offload: bool, fixed_units: bool,
) -> str:
    """How `apply_fsdp` lays the blocks out: "cast" (one-rank shard group: no FSDP at all, smp's
    own mixed precision, bitwise FSDP's), "merged" (FSDP units of at least MIN_UNIT_BYTES) or
    "blocks" (one FSDP unit per block: CPU offload streams a block at a time; `fixed_units`:
    smp's gradient-sync collectives, whose block quantisation follows the unit, or pipeline stages,
    whose schedules drive FSDP's units themselves)."""
    if cpu_offload or fixed_units:
        return "blocks"
    from torch.distributed.fsdp import FSDPModule

    cast_ok = (
        shard_ranks == 1
        and reshard_after_forward is False  # set true by the user: FSDP frees each block's casts after its forward
        # FSDP accumulates no_sync gradients in the reduce dtype and hands them to the parameter in
        # the parameter's dtype; the cast layout sums float32 gradients into float32 parameters.
        and (reduce_dtype == torch.float32 or reduce_dtype is None and param_dtype is None)
        and all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
        and not any(isinstance(p, DTensor) for p in model.parameters())  # TP: FSDP sums Partial grads in param_dtype
        and not any(isinstance(m, FSDPModule) for m in model.modules())  # experts already FSDP units
    )
    return "cast" if cast_ok else "merged"


def unit_groups(sizes: list[int], parents: list[int], min_bytes: int) -> list[list[int]]:
    """Block indices merged into units: consecutive blocks of one parent (`parents`: an id per
    block) until a unit holds at least `min_bytes` (a short tail joins the unit before it);
    `min_bytes` 0 leaves one block per unit."""
    groups: list[list[int]] = []
    held = 0
    for index, size in enumerate(sizes):
        if groups and held < min_bytes and parents[groups[-1][-1]] == parents[index]:
            groups[-1].append(index)
            held += size
            continue
        groups.append([index])
        held = size
    if len(groups) > 1 and held < min_bytes and parents[groups[-2][-1]] == parents[groups[-1][0]]:
        groups[-2].extend(groups.pop())
    return groups


def block_parents(model: nn.Module, blocks: list[nn.Module]) -> list[int]:
    """An id of each block's parent module: only siblings merge into one unit."""
    parent = {id(child): id(module) for module in model.modules() for child in module.children()}
    return [parent.get(id(b), 0) for b in blocks]


def block_bytes(block: nn.Module) -> int:
    """Bytes of `block`'s parameters on this rank before FSDP (local shards of TP weights)."""
    return sum(dtensor_local(p).numel() * p.element_size() for p in block.parameters())


def describe_layout(model: nn.Module) -> str:
    """One line on how `apply_fsdp` laid `model` out (for `smp plan`); '' when it did not run."""
    return getattr(model, "_smp_unit_layout", "")


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
    fixed_units: bool = False,
    min_unit_bytes: int = MIN_UNIT_BYTES,
) -> nn.Module:
    """Shard `blocks` over `mesh` in FSDP units (see `unit_layout`), then the root (embeddings,
    head, the rest); over a one-rank mesh, cast parameters without FSDP where that is exact.

    The dtypes and `cast_forward_inputs` make FSDP2's MixedPrecisionPolicy (None keeps a
    parameter's own dtype); `reshard_after_forward` applies to the blocks; `cpu_offload` keeps
    parameters, gradients and optimizer state in host memory.
    """
    scalars = scalar_parameters(model)
    layout = unit_layout(model, mesh.size(), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                         reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload, fixed_units=fixed_units)
    if layout == "cast":
        CastParameters(model, blocks, param_dtype=param_dtype, output_dtype=output_dtype,
                       cast_forward_inputs=cast_forward_inputs, skip=scalars)
        model._smp_unit_layout = (
            f"unit layout: no FSDP units (one-rank shard group): parameters cast to "
            f"{str(param_dtype).removeprefix('torch.')} at each forward, gradients cast to float32 as backward "
            f"produces them (what FSDP's per-block units compute, bitwise, without their per-unit host cost)")
        return model
    groups = unit_groups([block_bytes(b) for b in blocks], block_parents(model, blocks),
                         min_unit_bytes if layout == "merged" else 0)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype,
        cast_forward_inputs=cast_forward_inputs,
    )
    # 0-d parameters (CLIP's logit_scale), which fully_shard refuses: whole on every rank,
    # gradient averaged after backward (smp/sharding/scalars.py).
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy(cpu_offload),
                  shard_placement_fn=fsdp_shard_placement,  # packed TP weights shard on their other dim
                  ignored_params=scalars or None)
    for group in groups:  # fully_shard of a list: one unit; each module still casts its own inputs
        units = [blocks[i] for i in group]
        fully_shard(units[0] if len(units) == 1 else units, reshard_after_forward=reshard_after_forward, **kwargs)
    model._smp_unit_layout = _merged_note(groups, len(blocks), min_unit_bytes if layout == "merged" else 0)
    # The root's parameters are needed again right at the start of backward (the LM head is
    # the last layer): keeping them gathered after forward saves one all-gather per step.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    average_scalar_gradients(scalars, mesh)
    return model


def _merged_note(groups: list[list[int]], blocks: int, min_bytes: int) -> str:
    if len(groups) == blocks:
        why = "one per block" if min_bytes == 0 else f"each block holds {min_bytes / 2**20:.0f} MiB or more"
        return f"unit layout: {blocks} FSDP units ({why}) + the root"
    sizes = ", ".join(str(len(g)) for g in groups[:8]) + (" ..." if len(groups) > 8 else "")
    units = f"{len(groups)} FSDP unit{'s' if len(groups) > 1 else ''}"
    return (f"unit layout: {units} over {blocks} blocks + the root (consecutive blocks merged "
            f"into units of at least {min_bytes / 2**20:.0f} MiB, MIN_UNIT_BYTES: {sizes} blocks a unit)")


def cast_transient_bytes(model: nn.Module, param_bytes: int) -> int:
    """The cast layout's transient: every parameter's cast copy, alive from the forward that
    makes it until its gradient lands (FSDP's units over one rank kept as much: each unit stays
    gathered from forward to its backward)."""
    return sum(dtensor_local(p).numel() for p in model.parameters()) * param_bytes
