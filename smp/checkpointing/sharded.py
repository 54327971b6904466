"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save, load, async save, wait.

Layout of a checkpoint directory (plain DCP at its root, so `dcp.load` works without smp):
  .metadata, __<rank>_0.distcp   DCP: {"model": <model state dict>, "optim": <optimizer's>}
                                  keyed by clean parameter names (no FSDP / wrapper prefixes)
                                  and stored as global tensors, so any world size, hybrid
                                  degree or tensor-parallel degree can load them (DCP reshards)
  smp_extra/rank_<r>.pt           torch.save({"extra": ..., "rng": ...}) of rank r
  smp_meta.json                   versions, world size, degrees, parameter names/shapes
  smp_commit.json                 commit marker, written last (see atomic.py)
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from smp._version import __version__
from smp.checkpointing import atomic, metadata, rng
from smp.errors import CheckpointError
from smp.mesh import ParallelDims

log = logging.getLogger(__name__)

EXTRA_DIR = "smp_extra"

_pending: Future | None = None  # the commit job of the last async save
_async_group: dist.ProcessGroup | None = None
_async_group_world: dist.ProcessGroup | None = None  # the default group it was made under
_executor: ThreadPoolExecutor | None = None


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def on_rank0(fn, what: str) -> None:
    """Run a filesystem step on rank 0; every rank returns after it, or raises its error.

    Doubles as the barrier: no rank is left waiting in a collective when rank 0 fails.
    """
    error = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
    if _dist():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(f"{what} failed on rank 0: {error}")


def _agree_on_tmp(path: str, kind: str = "sharded") -> str:
    """Rank 0 clears and creates the partial directory; the others wait for it."""
    tmp = atomic.partial_dir(path)

    def make() -> None:
        atomic.prepare(path, kind)
        if kind == "sharded":
            os.makedirs(os.path.join(tmp, EXTRA_DIR))

    on_rank0(make, f"creating checkpoint directory {tmp!r}")
    return tmp


def _write_extra(tmp: str, extra: Any) -> None:
    error = None
    try:
        torch.save({"extra": extra, "rng": rng.capture()}, os.path.join(tmp, EXTRA_DIR, f"rank_{_rank()}.pt"))
    except Exception as e:  # noqa: BLE001 - unpicklable extra, disk errors: reported below
        error = f"{type(e).__name__}: {e}"
    if _dist():  # a rank that failed must not leave the others waiting inside dcp.save
        errors = [None] * _world()
        dist.all_gather_object(errors, error)  # object collectives work on gloo and NCCL alike
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        error = "; ".join(failed) if failed else None
    if error:
        raise CheckpointError(f"cannot save `extra` (it must be picklable with torch.save): {error}")


def _commit(path: str, meta: dict[str, Any], keep_last: int | None) -> None:
    """(rank 0) After every rank's shards are written: metadata, marker, rename, cleanup."""
    tmp = atomic.partial_dir(path)
    metadata.write(tmp, meta)
    atomic.commit(path)
    if keep_last is not None:
        # The new checkpoint is committed: failing to delete an old one must not report the
        # save as failed (latest() already returns the new one).
        try:
            removed = atomic.keep_last(os.path.dirname(os.path.abspath(path)), keep_last, protect=path)
        except OSError as e:
            log.warning("smp.checkpointing: keep_last=%s could not remove old checkpoints: %s", keep_last, e)
        else:
            if removed:
                log.info("smp.checkpointing: removed old checkpoints %s", removed)


def _get_async_group(timeout_seconds: float | None) -> dist.ProcessGroup | None:
    """A gloo group of its own for the background save: its collectives run in another thread
    and must never interleave with the training step's collectives on the default group.
    `timeout_seconds` applies when the group is made (None: torch's default)."""
    global _async_group, _async_group_world
    if not _dist():
        return None
    world = dist.distributed_c10d._get_default_group()
    if _async_group is None or _async_group_world is not world:  # new process group since
        timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
        _async_group, _async_group_world = dist.new_group(backend="gloo", timeout=timeout), world
    return _async_group


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    async_save: bool = False,
    keep_last: int | None = None,
    dims: ParallelDims | None = None,
    collective_timeout_seconds: float | None = None,
) -> None:
    """`smp.checkpointing.save` (see there), with smp's run passed in: `dims`, the degrees the
    checkpoint records, and `collective_timeout_seconds`, the timeout of the async save's own
    group, so that a rank dying mid-upload does not stall wait(), shutdown() and interpreter
    exit for torch's 30 minutes. None for both under plain torch.distributed.
    """
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: keep at least 1 checkpoint, or pass None to keep all")
    wait()
    path = os.path.abspath(os.fspath(path))
    # DCP fills an optimizer that has not stepped yet with a zero-lr step (Adam's step count
    # becomes 1). We undo that on the live optimizer and on load, so saving never changes the run.
    fresh_optimizer = optimizer is not None and not optimizer.state
    state = _state_dicts(model, optimizer)
    meta = metadata.build(metadata.tensor_shapes(state["model"]), optimizer is not None, "sharded", dims)
    meta["optimizer_fresh"] = fresh_optimizer
    meta["optimizer_class"] = type(optimizer).__name__ if optimizer is not None else None
    tmp = _agree_on_tmp(path)
    try:
        _write_extra(tmp, extra)
        if async_save:
            # Returns after the host copy.
            _start_async(path, tmp, state, meta, keep_last, collective_timeout_seconds)
            if fresh_optimizer:
                optimizer.state.clear()
            return
        dcp.save(state, checkpoint_id=tmp, no_dist=not _dist())  # raises on every rank if any fails
        if fresh_optimizer:
            optimizer.state.clear()
        # Nobody returns before the checkpoint is visible to all (or all know it failed).
        on_rank0(lambda: _commit(path, meta, keep_last), f"committing checkpoint {path!r}")
    except BaseException:
        if _rank() == 0 and not async_save:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _start_async(
    path: str, tmp: str, state: dict, meta: dict, keep_last: int | None, timeout_seconds: float | None
) -> None:
    global _pending, _executor
    group = _get_async_group(timeout_seconds)
    upload = dcp.async_save(state, checkpoint_id=tmp, process_group=group, no_dist=not _dist())
    rank = _rank()

    def finish() -> None:
        upload.result()  # on rank 0 this returns after every rank's shards are written
        if rank == 0:
            _commit(path, meta, keep_last)

    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smp-ckpt-commit")
    _pending = _executor.submit(finish)


def wait() -> None:
    """Finish a pending async save (collective when one is pending); re-raise its error."""
    global _pending
    job, _pending = _pending, None
    if job is None:
        return
    error = None
    try:
        job.result()
    except BaseException as e:  # noqa: BLE001 - raised below, on every rank
        error = f"{type(e).__name__}: {e}"
    errors = [error]
    if _dist():  # doubles as the barrier: the checkpoint is committed for all, or failed for all
        errors = [None] * _world()
        dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError("async checkpoint save failed (not committed):\n  " + "\n  ".join(failed))


def wait_at_shutdown() -> None:
    """`smp.shutdown` calls this (a shutdown hook, registered by smp.checkpointing): commit a
    pending async save before the process group goes.
    A failure is logged, not raised (shutdown must finish); that checkpoint stays uncommitted,
    so latest() never returns it."""
    try:
        wait()
    except BaseException as e:  # noqa: BLE001
        log.error("smp.checkpointing: the pending async save failed and was not committed: %s", e)


def _check_directory(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a file, not a checkpoint directory")
    if os.path.basename(path).endswith(atomic.PARTIAL_SUFFIX) or (
        os.path.exists(os.path.join(path, ".metadata")) and not atomic.is_committed(path)
    ):
        raise CheckpointError(
            f"{path!r} is an incomplete checkpoint (its save never committed); "
            f"use smp.checkpointing.latest(root) to find the newest complete one"
        )
    if not atomic.is_committed(path) or not os.path.exists(os.path.join(path, metadata.META_FILE)):
        raise CheckpointError(
            f"{path!r} is not an smp checkpoint (no {atomic.COMMIT_FILE} / {metadata.META_FILE}); "
            f"pass a directory written by smp.checkpointing.save (export_hf folders load with load_hf)"
        )
    meta = metadata.read(path)
    for name, saved, running in (
        ("torch", meta.get("torch_version"), torch.__version__),
        ("smp", meta.get("smp_version"), __version__),
    ):
        if saved != running and _rank() == 0:
            log.warning("smp.checkpointing.load: %r was saved with %s %s, this is %s %s",
                        path, name, saved, name, running)
    if meta.get("kind") != "sharded":
        raise CheckpointError(f"{path!r} is an smp {meta.get('kind')!r} export; load it with smp.checkpointing.load_hf")
    return meta


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint into an (already transformed) model and optimizer; return `extra`.

    Works at any world size and parallel degrees: each rank reads the slices of the global
    tensors it owns. RNG states are restored when the world size is the one saved with (exact
    resume); after resharding there is no rank-for-rank match, so generators are left alone.
    """
    wait()
    if path is None:
        raise CheckpointError(
            "load(None, ...): no checkpoint path given (latest(root) returns None when root "
            "holds no complete checkpoint)"
        )
    path = os.path.abspath(os.fspath(path))
    meta = _check_directory(path)
    # Every check before the optimizer is touched (DCP initialises an empty one with a step).
    shapes = metadata.tensor_shapes(get_model_state_dict(model))
    metadata.check_compatible(meta["params"], shapes, f"checkpoint {path!r}")
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(
            f"checkpoint {path!r} holds no optimizer state (saved without one); "
            f"call load(path, model) and start the optimizer fresh"
        )
    saved_class = meta.get("optimizer_class")
    if optimizer is not None and saved_class and saved_class != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint {path!r} holds {saved_class} optimizer state, but a "
            f"{type(optimizer).__name__} optimizer was passed; build the optimizer the run was "
            f"saved with, or call load(path, model) and start the new optimizer fresh"
        )
    state = _state_dicts(model, optimizer)
    dcp.load(state, checkpoint_id=path, no_dist=not _dist())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if meta.get("optimizer_fresh"):
            optimizer.state.clear()  # saved before its first step: it had no state to restore
    return _read_extra(path, meta)


def _read_extra(path: str, meta: dict[str, Any]) -> Any:
    same_world = meta.get("world_size") == _world()
    own = os.path.join(path, EXTRA_DIR, f"rank_{_rank()}.pt")
    file = own if same_world and os.path.exists(own) else os.path.join(path, EXTRA_DIR, "rank_0.pt")
    if not os.path.exists(file):
        return None
    saved = torch.load(file, weights_only=False)  # our own pickle: scheduler / loader states
    if same_world and file == own:
        rng.restore(saved["rng"])
    elif _rank() == 0:
        log.warning(
            "smp.checkpointing.load: saved at world size %s, loading at %s; RNG states not "
            "restored (no rank-for-rank match)", meta.get("world_size"), _world(),
        )
    return saved["extra"]
