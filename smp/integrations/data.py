"""Data loaders sharded by smp's data-parallel rank, not by the world rank; eval outputs gathered
over the data-parallel ranks only.

accelerate gives process i of n every n-th batch. Under tensor parallelism the ranks of one TP
group must see the same batch, so the shard index is smp.state.dp_rank and the shard count
smp.state.dp_size. We call accelerate's own `prepare_data_loader` with those two numbers, so
the seedable sampler, epoch handling, `skip_first_batches` on resume and device placement stay
accelerate's; only the sharding changes, and it happens once.

Evaluation gathers what each rank predicted. Gathered over all ranks, every row would come once
per TP rank (the ranks of a TP group predicted the same rows); gathered over the dp group of
this rank's TP index, each row comes once, in dp-rank order, as the loader split them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply
from torch.utils.data import DataLoader

from smp._compat import is_prepared, track_dataloader


def prepare_data_loader_by_dp(
    accelerator: Accelerator, data_loader: DataLoader, dp_rank: int, dp_size: int, device_placement: bool | None = None,
    *, peers: bool = False, slice_fn_for_dispatch: Any = None,
) -> DataLoader:
    """`accelerator.prepare_data_loader`, sharded over `dp_size` data-parallel ranks (this one is
    `dp_rank`) instead of over every process. `peers`: other processes (TP / CP / PP ranks) read
    this rank's rows too (`slice_fn_for_dispatch` is accelerate's; batches are never dispatched)."""
    if is_prepared(data_loader):
        return data_loader
    if device_placement is None:
        device_placement = accelerator.device_placement
    rng_types = list(accelerator.rng_types or [])
    if peers and dp_size == 1 and "torch" not in rng_types:
        # With one shard accelerate leaves the loader as it is: a shuffling sampler draws its
        # order from the process's torch generator when iteration starts, as one process does.
        # Peers must draw the same order: each iteration starts from rank 0's torch generator
        # (accelerate's own synchronisation, over every process).
        rng_types.append("torch")
    prepared = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=dp_size,
        process_index=dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=rng_types,
        # Dispatching (rank 0 reads, then scatters over all processes) would split by world rank.
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
        torch_device_mesh=None,  # the shard numbers above already account for the mesh
    )
    track_dataloader(accelerator, prepared)  # as Accelerator.prepare_data_loader does: free_memory() drops it
    return prepared


def _all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The group's tensors concatenated along dim 0 (a 0-d tensor counts as one row), as accelerate's gather."""
    tensor = tensor.reshape(1) if tensor.ndim == 0 else tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=0)


def gather_by_dp(input_data: Any, *, group: dist.ProcessGroup) -> Any:
    """`accelerator.gather` over `group` (this rank's data-parallel ranks): tensors (nested)
    concatenated along dim 0, in dp-rank order."""
    return recursively_apply(functools.partial(_all_gather_rows, group=group), input_data, error_on_other_type=True)


def reduce_by_dp(input_data: Any, reduction: str = "sum", scale: float = 1.0, *, group: dist.ProcessGroup) -> Any:
    """`accelerator.reduce` over `group`: "sum" or "mean" over the data-parallel ranks, times `scale`."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if reduction != "none":
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
            if reduction == "mean":
                out /= dist.get_world_size(group)
        return out * scale if scale != 1.0 else out

    return recursively_apply(one, input_data, error_on_other_type=True)


def gather_for_metrics_by_dp(
    accelerator: Accelerator, input_data: Any, use_gather_object: bool = False, *, group: dist.ProcessGroup
) -> Any:
    """`accelerator.gather_for_metrics` over `group` (this rank's data-parallel ranks) instead of
    over every process: tensors (nested) are concatenated along dim 0, other objects (lists) are
    joined; the padding rows of the last batch are dropped as accelerate drops them."""
    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    as_objects = use_gather_object or not all_tensors
    if as_objects:
        objects = [None] * dist.get_world_size(group)
        dist.all_gather_object(objects, input_data, group=group)
        data = [x for part in objects for x in part]
    else:
        data = recursively_apply(functools.partial(_all_gather_rows, group=group), input_data)
    state = accelerator.gradient_state
    # The loader was sharded over the dp ranks (prepare_data_loader_by_dp), so its remainder
    # counts rows of the dp-wide last batch: exactly what this gather returns.
    if state.end_of_dataloader and state.remainder > 0:
        if as_objects:
            return data[: state.remainder]
        return recursively_apply(lambda t: t[: state.remainder], data)
    return data
