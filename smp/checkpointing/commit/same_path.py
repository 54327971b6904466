"""Every rank of a collective save (or load) names the same checkpoint path, checked before
anything is written.

DCP writes one checkpoint together: each rank its shards, the coordinator the `.metadata` that
indexes them all. Ranks that pass different paths scatter one checkpoint over several folders,
only one of which gets the index; the save "succeeds" and the folders cannot be loaded. So the
ranks of the save's process group compare their paths first, and a disagreement raises on every
one of them, naming two of the paths and the ranks that passed them.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from smp.errors import CheckpointError


def agree_on_path(path: str | os.PathLike, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group` (default: all ranks): raise CheckpointError on every rank of it
    when its ranks passed different paths. A no-op without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    mine = os.path.abspath(os.fspath(path))
    paths: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(paths, mine, group=group)
    if len(set(paths)) == 1:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(paths)))
    other = next(i for i, p in enumerate(paths) if p != paths[0])
    raise CheckpointError(
        f"{what}: the ranks passed different checkpoint paths (rank {ranks[0]}: {paths[0]!r}, rank "
        f"{ranks[other]}: {paths[other]!r}); every rank of the save must pass the same path, the "
        f"ranks together write one checkpoint there. A script that saves per tensor-parallel rank "
        f"into its own folder passes process_group=model.process_group (the ranks that share that "
        f"folder); otherwise pass one path on every rank"
    )
