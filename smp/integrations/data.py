"""Data loaders sharded by smp's data-parallel rank, not by the world rank.

accelerate gives process i of n every n-th batch. Under tensor parallelism the ranks of one TP
group must see the same batch, so the shard index is smp.state.dp_rank and the shard count
smp.state.dp_size. We call accelerate's own `prepare_data_loader` with those two numbers, so
the seedable sampler, epoch handling, `skip_first_batches` on resume and device placement stay
accelerate's; only the sharding changes, and it happens once.
"""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader


def prepare_data_loader_by_dp(
    accelerator: Accelerator, data_loader: DataLoader, dp_rank: int, dp_size: int, device_placement: bool | None = None
) -> DataLoader:
    """`accelerator.prepare_data_loader`, sharded over `dp_size` data-parallel ranks (this one is
    `dp_rank`) instead of over every process."""
    if getattr(data_loader, "_is_accelerate_prepared", False):
        return data_loader
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=dp_size,
        process_index=dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=list(accelerator.rng_types),
        # Dispatching (rank 0 reads, then scatters over all processes) would split by world rank.
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
        torch_device_mesh=None,  # the shard numbers above already account for the mesh
    )
    accelerator._dataloaders.append(prepared)  # as Accelerator.prepare_data_loader does: free_memory() drops it
    return prepared
