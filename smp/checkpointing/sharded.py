"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save, load, async save, wait.

Layout of a checkpoint directory (plain DCP at its root, so `dcp.load` works without smp):
  .metadata, __<rank>_0.distcp   DCP: {"model": <model state dict>, "optim": <optimizer's>}
                                  keyed by clean parameter names (no FSDP / wrapper prefixes)
                                  and stored as global tensors, so any world size, hybrid
                                  degree or tensor-parallel degree can load them (DCP reshards)
  smp_extra/rank_<r>.pt           torch.save({"extra": ..., "rng": ...}) of rank r
  smp_meta.json                   versions, world size, degrees, parameter names/shapes,
                                  optimizer options, run id, every file's size and digest
  smp_commit.json                 commit marker, written last (see atomic.py)

Load treats the folder as untrusted input, in this order, every rank agreeing at each step
before the next: smp_meta.json is checked field by field; the model and optimizer are
compared with it; every file is checked against its digest (each rank hashes the files its
rank wrote, from the bytes DCP reads: inline_digest.py); every pickle is read through an
allow-list (safe_read.py); DCP loads into a copy of the state, which replaces the model's and
optimizer's only once everything succeeded. A failed load leaves both untouched.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from smp._version import __version__
from smp.checkpointing import atomic, digest, inline_digest, metadata, rng, safe_read
from smp.errors import CheckpointError
from smp.mesh import ParallelDims

log = logging.getLogger(__name__)

EXTRA_DIR = "smp_extra"

_pending: Future | None = None  # the commit job of the last async save
_pending_partial: str | None = None  # its partial folder, removed by wait() if it failed
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
        atomic.prepare(path, atomic.run_id(), kind)
        if kind == "sharded":
            try:
                os.makedirs(os.path.join(tmp, EXTRA_DIR))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # the folder prepare made just now
                raise

    on_rank0(make, f"creating checkpoint directory {tmp!r}")
    return tmp


def _local_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in `state`: about what it writes."""
    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    return 0


def _causes(e: BaseException) -> list[BaseException]:
    """`e`, its chained causes, and the per-rank exceptions a DCP CheckpointException carries."""
    found, stack = [], [e]
    while stack:
        x = stack.pop()
        if x is None or any(x is y for y in found):
            continue
        found.append(x)
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return found


def _summary(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        return "; ".join(f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in sorted(failures.items()))
    return f"{type(e).__name__}: {e}"


def _is_disk_full(e: BaseException, directory: str, needed: int) -> bool:
    """ENOSPC / EDQUOT anywhere in the error (exceptions from other ranks arrive pickled, as
    text), or less free space than the save needs: torch.save's C++ writer reports a full
    disk only as `[enforce fail at inline_container.cc] unexpected pos`."""
    for x in _causes(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(x) or "Disk quota exceeded" in str(x):
            return True
    if not any(isinstance(x, OSError) or "unexpected pos" in str(x) for x in _causes(e)):
        return False  # not a write failure (an unpicklable `extra`, a planner error)
    try:
        return shutil.disk_usage(directory).free < needed
    except OSError:
        return False


def _save_error(e: BaseException, path: str, needed: int) -> CheckpointError:
    """The CheckpointError for a failed write of checkpoint `path` (`needed`: its bytes)."""
    directory = os.path.dirname(path)
    if _is_disk_full(e, directory, needed):
        try:
            free = f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB are free there"
        except OSError:
            free = "free space unknown"
        return CheckpointError(
            f"disk full: saving checkpoint {path!r} needs about {needed / 2**20:.1f} MiB (all "
            f"ranks' shards), {free}. Free space or save elsewhere; the partial files are removed "
            f"and the previous checkpoint is intact ({_summary(e)})"
        )
    return CheckpointError(f"saving checkpoint {path!r} failed (not committed; the previous checkpoint "
                           f"is intact): {_summary(e)}")


def _disk_full_or(e: CheckpointError, path: str, needed: int) -> CheckpointError:
    """The disk-full error when a full disk made rank 0's step of saving `path` fail, else `e`."""
    return _save_error(e, path, needed) if _is_disk_full(e, os.path.dirname(path), needed) else e


def _write_extra(tmp: str, extra: Any, path: str, needed: int) -> None:
    error = None
    try:
        torch.save({"extra": extra, "rng": rng.capture()}, os.path.join(tmp, EXTRA_DIR, f"rank_{_rank()}.pt"))
    except Exception as e:  # noqa: BLE001 - unpicklable extra, disk errors: reported below
        error = (f"{type(e).__name__}: {e}", _is_disk_full(e, tmp, needed))
    errors = [error]
    if _dist():  # a rank that failed must not leave the others waiting inside dcp.save
        errors = [None] * _world()
        dist.all_gather_object(errors, error)  # object collectives work on gloo and NCCL alike
    failed = [f"rank {r}: {e[0]}" for r, e in enumerate(errors) if e]
    if any(e and e[1] for e in errors):
        raise _save_error(OSError(errno.ENOSPC, "; ".join(failed)), path, needed)
    if failed:
        raise CheckpointError(f"cannot save `extra` (it must be picklable with torch.save): {'; '.join(failed)}")


# Files of a checkpoint that are not data: written after the digests are taken.
_BOOKKEEPING = frozenset({metadata.META_FILE, atomic.COMMIT_FILE, atomic.PARTIAL_FILE})


def _gather_digests(tmp: str, group: dist.ProcessGroup | None, written: dict[str, dict]) -> dict[str, dict]:
    """Every data file's size and digest. Each rank describes the files it wrote: with the
    digest its writer took while writing (`written`), else (DCP's `.metadata`, written under
    another name and renamed; `extra`) by hashing the file. Collective on `group`."""
    rank, world = _rank(), _world()
    result: tuple[dict, str | None] = ({}, None)
    try:
        mine = [f for f in digest.data_files(tmp, _BOOKKEEPING) if digest.writer_rank(f) % world == rank]
        known = {f: written[f] for f in mine
                 if f in written and written[f]["bytes"] == os.path.getsize(os.path.join(tmp, f))}
        result = ({**digest.describe(tmp, [f for f in mine if f not in known], digest.algorithm()), **known}, None)
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        result = ({}, f"rank {rank}: {type(e).__name__}: {e}")
    results = [result]
    if _dist():
        results = [None] * world
        dist.all_gather_object(results, result, group=group)
    failed = [err for _, err in results if err]
    if failed:
        raise CheckpointError("recording the checkpoint's file digests failed: " + "; ".join(failed))
    files: dict[str, dict] = {}
    for part, _ in results:
        files.update(part)
    return files


def _commit(path: str, meta: dict[str, Any], keep_last: int | None) -> None:
    """(rank 0) After every rank's shards are written: metadata, marker, rename, cleanup."""
    tmp = atomic.partial_dir(path)
    metadata.write(tmp, meta)
    atomic.commit(path, run_id=meta["run_id"])
    if keep_last is not None:
        # The new checkpoint is committed: failing to delete an old one must not report the
        # save as failed (latest() already returns the new one).
        try:
            removed = atomic.keep_last(os.path.dirname(os.path.abspath(path)), keep_last, protect=path,
                                       run_id=meta["run_id"])
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
    meta.update(metadata.describe_optimizer(optimizer), optimizer_fresh=fresh_optimizer, run_id=atomic.run_id())
    needed = _local_bytes(state) * _world()
    try:
        tmp = _agree_on_tmp(path)
    except CheckpointError as e:
        raise _disk_full_or(e, path, needed) from None
    background = False  # once the async job runs, it owns the partial folder (wait() cleans it)
    try:
        _write_extra(tmp, extra, path, needed)
        if async_save:
            # Returns after the host copy.
            _start_async(path, tmp, state, meta, keep_last, collective_timeout_seconds, needed)
            background = True
            return
        try:
            writer = inline_digest.HashingWriter(tmp, digest.algorithm())
            dcp.save(state, storage_writer=writer, no_dist=not _dist())  # raises on every rank if any fails
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _save_error(e, path, needed) from None
        meta["files"] = _gather_digests(tmp, None, writer.written_digests)
        # Nobody returns before the checkpoint is visible to all (or all know it failed).
        try:
            on_rank0(lambda: _commit(path, meta, keep_last), f"committing checkpoint {path!r}")
        except CheckpointError as e:
            raise _disk_full_or(e, path, needed) from None
    except BaseException:
        if _rank() == 0 and not background:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fresh_optimizer:
            optimizer.state.clear()


def _start_async(
    path: str, tmp: str, state: dict, meta: dict, keep_last: int | None, timeout_seconds: float | None,
    needed: int,
) -> None:
    global _pending, _pending_partial, _executor
    group = _get_async_group(timeout_seconds)
    writer = inline_digest.HashingWriter(tmp, digest.algorithm())
    upload = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=not _dist())
    rank = _rank()

    def finish() -> None:
        try:
            upload.result()  # returns after every rank's shards and DCP's .metadata are written
            meta["files"] = _gather_digests(tmp, group, writer.written_digests)
            if rank == 0:
                _commit(path, meta, keep_last)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too; reported by wait()
            raise _save_error(e, path, needed) from None

    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smp-ckpt-commit")
    _pending, _pending_partial = _executor.submit(finish), tmp


def wait() -> None:
    """Finish a pending async save (collective when one is pending); re-raise its error."""
    global _pending, _pending_partial
    job, tmp = _pending, _pending_partial
    _pending = _pending_partial = None
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
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("async checkpoint save failed (not committed; its partial files are removed, "
                              "the previous checkpoint is intact):\n  " + "\n  ".join(failed))


def wait_at_shutdown() -> None:
    """`smp.shutdown` calls this (a shutdown hook, registered by smp.checkpointing): commit a
    pending async save before the process group goes.
    A failure is logged, not raised (shutdown must finish); that checkpoint stays uncommitted,
    so latest() never returns it."""
    global _async_group, _async_group_world
    try:
        wait()
    except BaseException as e:  # noqa: BLE001
        log.error("smp.checkpointing: the pending async save failed and was not committed: %s", e)
    # This module's reference would keep the group, and its gloo threads, alive into interpreter
    # finalization (see smp/reliability/teardown.py). The next session's first async save makes
    # a new one. After wait(), no rank has work left on it: destroying it needs no peer.
    group, _async_group, _async_group_world = _async_group, None, None
    if group is not None and _dist() and group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)


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


def _agree(problem: str | None, what: str) -> None:
    """Collective: raise CheckpointError on every rank when any rank found a problem."""
    problems = [problem]
    if _dist():
        problems = [None] * _world()
        dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if found:
        raise CheckpointError(what + ":\n  " + "\n  ".join(dict.fromkeys(found)))


_DAMAGED = "checkpoint {path!r} is damaged or unsafe; nothing was loaded (latest(root) skips checkpoints with missing or truncated files)"


def _my_files(files: dict[str, Any]) -> list[str]:
    """The listed files this rank verifies: those its rank wrote (ranks split the reading)."""
    rank, world = _rank(), _world()
    return [f for f in sorted(files) if digest.writer_rank(f) % world == rank]


def _verify_structure(path: str, meta: dict[str, Any]) -> None:
    """Before anything is read: every listed file present, a regular file inside the folder, at
    its recorded size; the small files (DCP's `.metadata`, `extra`) also against their digests;
    on rank 0 `.metadata` through the allow-list, naming only listed files. The large data files'
    digests are checked from the bytes DCP reads (`_data_problems`). Collective."""
    files = meta.get("files")
    if files is None:  # format 1: saved before smp recorded digests
        if _rank() == 0:
            log.warning("smp.checkpointing.load: %r predates file digests; its files are not verified", path)
        return
    mine = _my_files(files)
    small = [f for f in mine if not f.endswith(".distcp")]
    found = digest.problems(path, files, mine, read=False) or digest.problems(path, files, small, read=True)
    if _rank() == 0 and not found:
        if safe_read.DCP_METADATA_FILE not in files:
            found.append(f"{safe_read.DCP_METADATA_FILE} is not among the files the save recorded")
        else:
            try:
                md = safe_read.read_dcp_metadata(path)
            except safe_read.UnsafeCheckpoint as e:
                found.append(str(e))
            else:
                unlisted = sorted({i.relative_path for i in md.storage_data.values()} - set(files))
                if unlisted:
                    found.append(f"{safe_read.DCP_METADATA_FILE} names files the save did not record: {unlisted[:5]}")
    _agree("\n  ".join(found) or None, _DAMAGED.format(path=path))


def _data_to_verify(meta: dict[str, Any]) -> dict[str, dict]:
    """This rank's share of the data files (those its rank wrote) with their recorded entries."""
    files = meta.get("files") or {}
    return {f: files[f] for f in _my_files(files) if f.endswith(".distcp")}


def _data_problems(path: str, mine: dict[str, dict], reader: inline_digest.VerifyingReader,
                   read_failed: bool) -> str | None:
    """This rank's problems with its share of the data files, `mine` (None when all match):
    checked from the bytes DCP read (`reader.checked`); a file DCP did not open (a resharded
    load reads other ranks' files) is hashed here. After a failed read every file is hashed
    again from disk, so that the damaged one is named whatever DCP stopped on."""
    found = [] if read_failed else [f"{f} {why}" for f, why in sorted(reader.checked.items()) if why]
    rest = sorted(mine) if read_failed else sorted(set(mine) - set(reader.checked))
    found += digest.problems(path, mine, rest, read=True)
    return "\n  ".join(found) or None


def _empty_copy(state: Any) -> Any:
    """A state dict of the same structure with new tensors (same shapes, dtypes, shardings):
    DCP loads into it, so that a failed load leaves the live model and optimizer untouched."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _empty_copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_copy(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_empty_copy(v) for v in state)
    return state


def load(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    *, allow_pickle: bool = False,
) -> Any:
    """Load a checkpoint into an (already transformed) model and optimizer; return `extra`.

    Works at any world size and parallel degrees: each rank reads the slices of the global
    tensors it owns. RNG states are restored when the world size is the one saved with (exact
    resume); after resharding there is no rank-for-rank match, so generators are left alone.

    Safe on a checkpoint from anyone: nothing in it runs as code, and a damaged, truncated or
    tampered one raises CheckpointError (naming the file) with the model and optimizer left
    as they were. `extra` comes back if it holds only tensors, numbers, strings, None, lists,
    tuples and dicts (or classes allowed with `torch.serialization.add_safe_globals`); other
    objects need `allow_pickle=True`, which unpickles `extra` as torch.load does and so runs
    whatever code the file names: pass it only for checkpoints you wrote.
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
    metadata.check_optimizer(meta, optimizer, f"checkpoint {path!r}")
    _verify_structure(path, meta)
    saved_extra, own_rng = _read_extra(path, meta, allow_pickle)
    fresh_optimizer = optimizer is not None and not optimizer.state
    # DCP reads into a copy of the state; the digests of this rank's files are taken from the
    # bytes it reads; all ranks agree they match before anything is copied into the model.
    mine = _data_to_verify(meta)
    reader = inline_digest.VerifyingReader(path, mine)
    load_error = None
    try:
        state = _empty_copy(_state_dicts(model, optimizer))
        dcp.load(state, storage_reader=reader, planner=safe_read.SafeLoadPlanner(), no_dist=not _dist())
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        load_error = e
    try:
        # Digests first: a damaged file is named even when DCP failed on it.
        _agree(_data_problems(path, mine, reader, load_error is not None), _DAMAGED.format(path=path))
        if load_error is not None:
            raise CheckpointError(f"loading checkpoint {path!r} failed; the model and optimizer are "
                                  f"unchanged: {_summary(load_error)}") from None
    except CheckpointError:
        if fresh_optimizer:
            optimizer.state.clear()  # undo DCP's initialising step: the optimizer is as it was
        raise
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if meta.get("optimizer_fresh"):
            optimizer.state.clear()  # saved before its first step: it had no state to restore
    atomic.adopt_run(meta.get("run_id"))
    if saved_extra is None:
        return None
    if own_rng:
        rng.restore(saved_extra["rng"])
    elif _rank() == 0:
        log.warning(
            "smp.checkpointing.load: saved at world size %s, loading at %s; RNG states not "
            "restored (no rank-for-rank match)", meta.get("world_size"), _world(),
        )
    return saved_extra["extra"]


def _read_extra(path: str, meta: dict[str, Any], allow_pickle: bool) -> tuple[Any, bool]:
    """This rank's `{"extra", "rng"}` (rank 0's after resharding; None if none was saved) and
    whether its RNG states are this rank's own. Collective: a rank that cannot read its file
    fails every rank, before any rank changes its model."""
    same_world = meta.get("world_size") == _world()
    own = os.path.join(path, EXTRA_DIR, f"rank_{_rank()}.pt")
    file = own if same_world and os.path.exists(own) else os.path.join(path, EXTRA_DIR, "rank_0.pt")
    saved, problem = None, None
    if os.path.exists(file):
        try:
            saved = safe_read.read_extra(file, allow_pickle)
            if not (isinstance(saved, dict) and "extra" in saved and "rng" in saved):
                raise ValueError(f"it holds a {type(saved).__name__}, not smp's {{extra, rng}}")
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            problem = f"{os.path.relpath(file, path)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if "weights_only" in str(e) or "Unsupported global" in str(e):
                problem += (
                    "\n  `extra` holds objects other than tensors, numbers, strings, lists, tuples "
                    "and dicts. If you trust this checkpoint, pass allow_pickle=True (it runs the "
                    "file's pickle) or allow their classes with torch.serialization.add_safe_globals"
                )
    _agree(problem, f"cannot read `extra` of checkpoint {path!r}; nothing was loaded")
    return saved, same_world and file == own
