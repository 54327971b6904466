"""`save` and `export_hf` as users call them: they read smp's run (when `smp.init` ran) here and
pass it to sharded.py / hf/ as plain values. Exported by the package (smp.checkpointing.save)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from smp import runtime
from smp.checkpointing import hf, sharded
from smp.checkpointing.hf import DEFAULT_MAX_SHARD_BYTES
from smp.checkpointing.hf import folder as hf_folder
from smp.mesh import ParallelDims


def _dims() -> ParallelDims | None:
    return runtime.current().dims if runtime.is_initialized() else None


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    async_save: bool = False,
    keep_last: int | None = None,
) -> None:
    """Save a sharded checkpoint of `model` (and `optimizer`, and `extra`) to `path`. Collective.

    `extra` is any picklable object (step, scheduler state, data-loader position), saved per
    rank together with the rank's RNG states and handed back by `load`; plain data (tensors,
    numbers, strings, lists, tuples, dicts) loads anywhere, other objects only with
    `load(..., allow_pickle=True)`. With `async_save` the
    call returns once the state is copied to host memory; storage writes and the commit happen
    in the background (`wait()` finishes them; the next save or load waits first).
    `keep_last=n` deletes all but the newest n committed checkpoints of this run beside `path`
    (never another run's, a symbolic link, or a folder smp did not write). A full disk raises
    CheckpointError on every rank saying how much was needed; the partial files are removed.
    """
    timeout = runtime.current().config.collective_timeout_seconds if runtime.is_initialized() else None
    sharded.save(
        path, model, optimizer, extra, async_save=async_save, keep_last=keep_last,
        dims=_dims(), collective_timeout_seconds=timeout,
    )


def export_hf(
    out_dir: str | os.PathLike,
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write `model` (sharded or not) as a Hugging Face safetensors folder. Collective.

    `dtype` casts on the way out (e.g. torch.bfloat16 for a half-size release); `max_shard_bytes`
    caps each safetensors file. Returns the folder's path. A folder that holds other files (a
    run's output_dir beside its step_N checkpoints) keeps them: the model files are written
    beside them, as save_pretrained does (smp.checkpointing.hf.folder).
    """
    if hf_folder.holds_other_files(out_dir):
        return hf_folder.export_into(out_dir, model, dims=_dims(), dtype=dtype, max_shard_bytes=max_shard_bytes)
    return hf.export_hf(out_dir, model, dtype=dtype, max_shard_bytes=max_shard_bytes, dims=_dims())
