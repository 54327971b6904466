"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save, load, async save, wait.

Layout of a checkpoint directory (plain DCP at its root, so `dcp.load` works without smp):
  .metadata, __<rank>_0.distcp   DCP: {"model": <model state dict>, "optim": <optimizer's>}
                                  keyed by clean parameter names (no FSDP / wrapper prefixes)
                                  and stored as global tensors, so any world size, hybrid
                                  degree or tensor-parallel degree can load them (DCP reshards)
  smp_extra/rank_<r>.pt           torch.save({"extra": ..., "rng": ...}) of rank r
  smp_meta.json                   versions, world size, degrees, parameter names/shapes,
                                  optimizer options, run id, every file's size and digest
  smp_commit.json                 commit marker, written last (see commit/atomic.py)

Load treats the folder as untrusted input, in this order, every rank agreeing at each step
before the next: smp_meta.json is checked field by field; the model and optimizer are
compared with it; every file is checked against its digest (each rank hashes the files its
rank wrote, from the bytes DCP reads: trust/inline_digest.py); every pickle is read through an
allow-list (trust/safe_read.py); DCP loads into a copy of the state, which replaces the model's and
optimizer's only once everything succeeded. A failed load leaves both untouched.

This module is the protocol (what is written and read, in which order); beside it:
trust/verify.py checks a folder before and while it loads, commit/async_save.py runs background
saves, commit/save_errors.py tells a full disk from other write failures, storage.py is every
filesystem operation (the seam where another storage would plug in), collective.py holds the
rank-0-step and agreement collectives every step uses.
"""

from __future__ import annotations

import errno
import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from smp.checkpointing import storage
from smp.checkpointing.collective import agree, is_dist, on_rank0, rank, world
from smp.checkpointing.commit import atomic, save_errors
from smp.checkpointing.commit.async_save import host_copy, saves, wait
from smp.checkpointing.commit.same_path import agree_on_path
from smp.checkpointing.commit.save_errors import disk_full_or, is_disk_full, save_error
from smp.checkpointing.format import metadata, packed, rng
from smp.checkpointing.format.pipeline import stages_view, whole_model_shapes
from smp.checkpointing.trust import digest, inline_digest, safe_read, verify
from smp.errors import CheckpointError
from smp.fp8 import plain_weights
from smp.mesh import ParallelDims

log = logging.getLogger(__name__)

EXTRA_DIR = "smp_extra"


@contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Hide the optimizer's parameter groups that hold no parameter while a flat (pipelined)
    optimizer state is loaded. The flat form keeps a group's settings per parameter, so an empty
    group has none to read back and torch's loader fails on it; scripts make such groups (Hugging
    Face's "no weight decay" group when no name matches it, or a stage holding none of a group's
    parameters). An empty group has no state to restore: it is put back as it was."""
    if optimizer is None or all(group["params"] for group in optimizer.param_groups):
        yield
        return
    groups = optimizer.param_groups
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [g if not g["params"] else next(loaded) for g in groups]


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None, flat: bool = False) -> dict[str, Any]:
    """The model's (and optimizer's) state under clean names. `flat`: the optimizer state as
    one entry per parameter (`state.<name>.exp_avg`, `param_groups.<name>.lr`), which a
    pipelined model's ranks need: each holds other parameters, and DCP keeps one rank's copy
    of a shared entry such as the nested `param_groups` list."""
    if optimizer is None:
        return {"model": plain_weights(get_model_state_dict(model))}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    # fp8.all_gather's weights are torchao subclasses: the checkpoint holds their plain tensors.
    return {"model": plain_weights(model_sd), "optim": optim_sd}


def _agree_on_tmp(path: str, kind: str = "sharded") -> str:
    """Rank 0 clears and creates the partial directory; the others wait for it."""
    tmp = atomic.partial_dir(path)
    run_id = atomic.run_id()  # made (a collective) on first use: before the rank-0-only step

    def make() -> None:
        atomic.prepare(path, run_id, kind)
        if kind == "sharded":
            fs = storage.current()
            try:
                fs.make_dirs(os.path.join(tmp, EXTRA_DIR))
            except BaseException:
                fs.remove_tree(tmp, ignore_errors=True)  # the folder prepare made just now
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


def _write_extra(tmp: str, extra: Any, path: str, needed: int) -> None:
    error = None
    try:
        storage.current().torch_save({"extra": extra, "rng": rng.capture()}, os.path.join(tmp, EXTRA_DIR, f"rank_{rank()}.pt"))
    except Exception as e:  # noqa: BLE001 - unpicklable extra, disk errors: reported below
        error = (f"{type(e).__name__}: {e}", is_disk_full(e, tmp, needed))
    errors = [error]
    if is_dist():  # a rank that failed must not leave the others waiting inside dcp.save
        errors = [None] * world()
        dist.all_gather_object(errors, error)  # object collectives work on gloo and NCCL alike
    failed = [f"rank {r}: {e[0]}" for r, e in enumerate(errors) if e]
    if any(e and e[1] for e in errors):
        raise save_error(OSError(errno.ENOSPC, "; ".join(failed)), path, needed)
    if failed:
        raise CheckpointError(f"cannot save `extra` (it must be picklable with torch.save): {'; '.join(failed)}")


# Files of a checkpoint that are not data: written after the digests are taken.
_BOOKKEEPING = frozenset({metadata.META_FILE, atomic.COMMIT_FILE, atomic.PARTIAL_FILE})


def _gather_digests(tmp: str, group: dist.ProcessGroup | None, written: dict[str, dict]) -> dict[str, dict]:
    """Every data file's size and digest. Each rank describes the files it wrote: with the
    digest its writer took while writing (`written`), else (DCP's `.metadata`, written under
    another name and renamed; `extra`) by hashing the file. Collective on `group`."""
    me, n = rank(), world()
    result: tuple[dict, str | None] = ({}, None)
    try:
        mine = [f for f in digest.data_files(tmp, _BOOKKEEPING) if digest.writer_rank(f) % n == me]
        known = {f: written[f] for f in mine
                 if f in written and written[f]["bytes"] == storage.current().size(os.path.join(tmp, f))}
        result = ({**digest.describe(tmp, [f for f in mine if f not in known], digest.algorithm()), **known}, None)
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        result = ({}, f"rank {me}: {type(e).__name__}: {e}")
    results = [result]
    if is_dist():
        results = [None] * n
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
    agree_on_path(path, "smp.checkpointing.save")  # before anything is written
    # DCP fills an optimizer that has not stepped yet with a zero-lr step (Adam's step count
    # becomes 1). We undo that on the live optimizer and on load, so saving never changes the run.
    fresh_optimizer = optimizer is not None and not optimizer.state
    # A pipelined model: this rank's stages under the whole model's names (pipeline.py).
    model, _, pp_group = stages_view(model)
    flat = pp_group is not None
    state = _state_dicts(model, optimizer, flat)
    try:
        shapes = whole_model_shapes(metadata.tensor_shapes(state["model"]), pp_group, f"saving checkpoint {path!r}")
    except CheckpointError:
        if fresh_optimizer:
            optimizer.state.clear()  # get_state_dict initialised it: saving never changes the run
        raise
    meta = metadata.build(shapes, optimizer is not None, "sharded", dims)
    meta.update(metadata.describe_optimizer(optimizer), optimizer_fresh=fresh_optimizer, run_id=atomic.run_id())
    if flat:
        meta["optimizer_flat"] = True
    # Packed tensor-parallel tensors (fused q|k|v, gate|up): DCP cannot express a rank's part
    # of them, so each rank writes the boxes it holds (packed.py). Collective: all ranks agree.
    planner = packed.PackedSavePlanner(packed.save_boxes(state, packed.packed_keys(state)))
    needed = _local_bytes(state) * world()
    try:
        tmp = _agree_on_tmp(path)
    except CheckpointError as e:
        raise disk_full_or(e, path, needed) from None
    background = False  # once the async job runs, it owns the partial folder (wait() cleans it)
    try:
        _write_extra(tmp, extra, path, needed)
        if async_save:
            # Returns after the host copy.
            _start_async(path, tmp, state, planner, meta, keep_last, collective_timeout_seconds, needed)
            background = True
            return
        try:
            writer = inline_digest.HashingWriter(tmp, digest.algorithm())
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=not is_dist())  # raises on every rank if any fails
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise save_error(e, path, needed) from None
        meta["files"] = _gather_digests(tmp, None, writer.written_digests)
        # Nobody returns before the checkpoint is visible to all (or all know it failed).
        try:
            on_rank0(lambda: _commit(path, meta, keep_last), f"committing checkpoint {path!r}")
        except CheckpointError as e:
            raise disk_full_or(e, path, needed) from None
    except BaseException:
        if rank() == 0 and not background:
            storage.current().remove_tree(tmp, ignore_errors=True)
        raise
    finally:
        if fresh_optimizer:
            optimizer.state.clear()


def _start_async(
    path: str, tmp: str, state: dict, planner: packed.PackedSavePlanner, meta: dict, keep_last: int | None,
    timeout_seconds: float | None, needed: int,
) -> None:
    jobs = saves()
    group = jobs.group(timeout_seconds)
    writer = inline_digest.HashingWriter(tmp, digest.algorithm())
    # One plain host copy of this rank's state (async_save.host_copy), written by DCP's ordinary
    # save in the background thread and dropped when written: DCP's own async stager keeps its
    # staging buffers (and more) after the save, seen at 1.5x the rank's state on torch 2.13.
    # Packed tensor-parallel boxes are staged contiguous by the planner (packed.py): the writer
    # takes them as they are, with no copy of its own on top of this one.
    staged = [host_copy(state, planner.stage(state))]
    me = rank()

    def finish() -> None:
        try:
            dcp.save(staged.pop(), storage_writer=writer, planner=planner, process_group=group, no_dist=not is_dist())
            meta["files"] = _gather_digests(tmp, group, writer.written_digests)
            if me == 0:
                _commit(path, meta, keep_last)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too; reported by wait()
            raise save_error(e, path, needed) from None

    jobs.submit(finish, tmp)


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
    *, allow_pickle: bool = False, allow_unverified: bool = False,
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

    A checkpoint saved before smp recorded file digests (`smp_meta.json` format_version 1, no
    `files`) cannot be verified: damaged bytes in it would load silently. It is refused unless
    `allow_unverified=True`, which loads it unchecked: pass it only for a checkpoint you trust,
    and save it again to give it digests.
    """
    wait()
    if path is None:
        raise CheckpointError(
            "load(None, ...): no checkpoint path given (latest(root) returns None when root "
            "holds no complete checkpoint)"
        )
    path = os.path.abspath(os.fspath(path))
    agree_on_path(path, "smp.checkpointing.load")
    # Every rank checks the folder it sees, then all agree: where ranks see different folders
    # (no shared filesystem, a folder changing under them) the one that finds a problem must
    # not leave the others waiting in the next collective.
    meta, problem = None, None
    try:
        meta = verify.check_directory(path)
    except CheckpointError as e:
        problem = str(e)
    agree(problem, f"loading checkpoint {path!r}")
    model, _, pp_group = stages_view(model)
    # Every check before the optimizer is touched (DCP initialises an empty one with a step).
    shapes = whole_model_shapes(metadata.tensor_shapes(get_model_state_dict(model)), pp_group,
                                f"loading checkpoint {path!r}")
    metadata.check_compatible(meta["params"], shapes, f"checkpoint {path!r}")
    metadata.check_optimizer(meta, optimizer, f"checkpoint {path!r}")
    verify.verify_structure(path, meta, allow_unverified)
    saved_extra, own_rng = _read_extra(path, meta, allow_pickle)
    fresh_optimizer = optimizer is not None and not optimizer.state
    flat = meta.get("optimizer_flat") is True  # saved by a pipelined model: one entry per parameter
    # DCP reads into a copy of the state; the digests of this rank's files are taken from the
    # bytes it reads; all ranks agree they match before anything is copied into the model.
    mine = verify.data_to_verify(meta)
    reader = inline_digest.VerifyingReader(path, mine)
    load_error = None
    try:
        state = _empty_copy(_state_dicts(model, optimizer, flat))
        # Packed tensor-parallel tensors are read box by box into their places (packed.py).
        dcp.load(state, storage_reader=reader, planner=packed.PackedLoadPlanner(), no_dist=not is_dist())
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        load_error = e
    try:
        # Digests first: a damaged file is named even when DCP failed on it.
        agree(verify.data_problems(path, mine, reader, load_error is not None), verify.DAMAGED.format(path=path))
        if load_error is not None:
            raise CheckpointError(f"loading checkpoint {path!r} failed; the model and optimizer are "
                                  f"unchanged: {save_errors.summary(load_error)}") from None
    except CheckpointError:
        if fresh_optimizer:
            optimizer.state.clear()  # undo DCP's initialising step: the optimizer is as it was
        raise
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        with _without_empty_groups(optimizer if flat else None):
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=StateDictOptions(flatten_optimizer_state_dict=flat))
        if meta.get("optimizer_fresh"):
            optimizer.state.clear()  # saved before its first step: it had no state to restore
    atomic.adopt_run(meta.get("run_id"))
    if saved_extra is None:
        return None
    if own_rng:
        rng.restore(saved_extra["rng"])
    elif rank() == 0:
        log.warning(
            "smp.checkpointing.load: saved at world size %s, loading at %s; RNG states not "
            "restored (no rank-for-rank match)", meta.get("world_size"), world(),
        )
    return saved_extra["extra"]


def _read_extra(path: str, meta: dict[str, Any], allow_pickle: bool) -> tuple[Any, bool]:
    """This rank's `{"extra", "rng"}` (rank 0's after resharding; None if none was saved) and
    whether its RNG states are this rank's own. Collective: a rank that cannot read its file
    fails every rank, before any rank changes its model."""
    same_world = meta.get("world_size") == world()
    own = os.path.join(path, EXTRA_DIR, f"rank_{rank()}.pt")
    fs = storage.current()
    file = own if same_world and fs.exists(own) else os.path.join(path, EXTRA_DIR, "rank_0.pt")
    saved, problem = None, None
    if fs.exists(file):
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
    agree(problem, f"cannot read `extra` of checkpoint {path!r}; nothing was loaded")
    return saved, same_world and file == own
