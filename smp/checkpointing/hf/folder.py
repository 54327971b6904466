"""A Hugging Face export into a folder that holds other files, as `save_pretrained` writes
into a run's output_dir beside its `step_N` folders.

smp.checkpointing.export_hf replaces its target folder atomically, so a folder holding other
files is exported here: into a staging folder inside the target, whose files are then moved up
(the old weight files removed first). The moves are ordered so that the folder never looks
complete while it is not: weights first, then the shard index, `config.json` last (and the
old `config.json` is removed with the old weights), so a run killed in between leaves a folder
`from_pretrained` refuses rather than one that mixes two saves.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.checkpointing import hf, storage
from smp.checkpointing.commit import atomic
from smp.checkpointing.hf import DEFAULT_MAX_SHARD_BYTES
from smp.errors import CheckpointError

_STAGING = ".smp_hf_export"
# What export_hf writes besides the weights: kept only inside the staging folder, so that the
# run folder never looks like an smp export (which a later export would replace whole).
_SMP_FILES = ("smp_meta.json", "smp_commit.json")
_INDEX = "model.safetensors.index.json"
_CONFIG = "config.json"


def export_into(out_dir: str | os.PathLike, model: nn.Module, *, dims: Any = None,
                dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Export `model` to `out_dir` (created if missing; other files there are kept). `dims`: the
    session's ParallelDims (None outside a session). Collective: every rank calls it."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    staging = os.path.join(out_dir, _STAGING)
    rank0 = _rank() == 0
    if rank0:
        # Left by an export that died mid-move: export_hf would refuse it (not a complete export).
        # Only rank 0 touches it, and export_hf's first step on rank 0 comes after this.
        storage.current().remove_tree(staging, ignore_errors=True)
    hf.export_hf(staging, model, dtype=dtype, max_shard_bytes=max_shard_bytes, dims=dims)
    error = None
    if rank0:
        try:
            _move_up(staging, out_dir)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)  # also the barrier: the folder is complete for all
        error = box[0]
    if error:
        raise CheckpointError(f"moving the export into {out_dir!r} failed on rank 0: {error}")
    return out_dir


def _move_up(staging: str, out_dir: str) -> None:
    """(rank 0) Replace the model files of `out_dir` by the staged ones, config last."""
    fs = storage.current()
    # Old weights of a previous save (another shard count) must not mix with the new ones.
    old_weights = [os.path.join(out_dir, n) for n in fs.list(out_dir) if fnmatch.fnmatchcase(n, "model*.safetensors")]
    for old in old_weights + [os.path.join(out_dir, _INDEX), os.path.join(out_dir, _CONFIG)]:
        if fs.is_file(old):
            fs.remove(old)
    names = [n for n in fs.list(staging) if n not in _SMP_FILES]
    last = [n for n in (_INDEX, _CONFIG) if n in names]
    for name in [n for n in names if n not in last] + last:
        fs.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    fs.remove_tree(staging)


def holds_other_files(out_dir: str | os.PathLike) -> bool:
    """Whether `out_dir` is a non-empty folder that is not an smp export (a run's output_dir),
    as rank 0 sees it, agreed by every rank. Collective when distributed."""
    path = os.path.abspath(os.fspath(out_dir))
    fs = storage.current()
    verdict = (fs.is_dir(path) and not fs.is_link(path) and bool(fs.list(path))
               and not atomic.is_committed(path))
    if dist.is_initialized():
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    return verdict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
