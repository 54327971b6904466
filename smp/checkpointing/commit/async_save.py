"""Background (async) saves: the gloo group their collectives run on, the thread that commits
them, and the pending job that `wait()` finishes, held by one `AsyncSaves` object that the
session owns (smp/scope.py): `smp.shutdown` closes it, committing a pending save first.

What a job does (DCP's upload, digests, commit) is sharded.py's; this module only runs it off
the training thread and reports its outcome on every rank.
"""

from __future__ import annotations

import copy
import datetime
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp._compat import group_is_alive
from smp.checkpointing import storage
from smp.checkpointing.collective import is_dist, rank, world
from smp.errors import CheckpointError
from smp.scope import Slot

log = logging.getLogger(__name__)


class AsyncSaves:
    """At most one async save in flight, with what it runs on; `close()` at shutdown."""

    def __init__(self) -> None:
        self._pending: Future | None = None  # the commit job of the last async save
        self._pending_partial: str | None = None  # its partial folder, removed by wait() if it failed
        self._group: dist.ProcessGroup | None = None
        self._group_world: dist.ProcessGroup | None = None  # the default group it was made under
        self._executor: ThreadPoolExecutor | None = None

    def group(self, timeout_seconds: float | None) -> dist.ProcessGroup | None:
        """A gloo group of its own for the background save: its collectives run in another
        thread and must never interleave with the training step's collectives on the default
        group. `timeout_seconds` applies when the group is made (None: torch's default)."""
        if not is_dist():
            return None
        default = dist.group.WORLD
        if self._group is None or self._group_world is not default:  # new process group since
            timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
            self._group, self._group_world = dist.new_group(backend="gloo", timeout=timeout), default
        return self._group

    def submit(self, finish: Callable[[], None], partial: str) -> None:
        """Run `finish` (the upload's commit job) in the background; `partial` is the folder
        wait() removes if it fails."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smp-ckpt-commit")
        self._pending, self._pending_partial = self._executor.submit(finish), partial

    def wait(self) -> None:
        """Finish a pending async save (collective when one is pending); re-raise its error."""
        job, tmp = self._pending, self._pending_partial
        self._pending = self._pending_partial = None
        if job is None:
            return
        error = None
        try:
            job.result()
        except BaseException as e:  # noqa: BLE001 - raised below, on every rank
            error = f"{type(e).__name__}: {e}"
        errors = [error]
        if is_dist():  # doubles as the barrier: the checkpoint is committed for all, or failed for all
            errors = [None] * world()
            dist.all_gather_object(errors, error)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            if rank() == 0:
                storage.current().remove_tree(tmp, ignore_errors=True)
            raise CheckpointError("async checkpoint save failed (not committed; its partial files are removed, "
                                  "the previous checkpoint is intact):\n  " + "\n  ".join(failed))

    def close(self) -> None:
        """At `smp.shutdown`: commit a pending async save before the process group goes.
        A failure is logged, not raised (shutdown must finish); that checkpoint stays
        uncommitted, so latest() never returns it."""
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001
            log.error("smp.checkpointing: the pending async save failed and was not committed: %s", e)
        if self._executor is not None:  # idle after wait(): its thread ends now, not at exit
            self._executor.shutdown(wait=True)
            self._executor = None
        # A reference kept here would keep the group, and its gloo threads, alive into
        # interpreter finalization (see smp/reliability/teardown.py). The next session's first
        # async save makes a new one. After wait(), no rank has work left on it: destroying it
        # needs no peer.
        group, self._group, self._group_world = self._group, None, None
        if group is not None and is_dist() and group_is_alive(group):
            dist.destroy_process_group(group)


def host_copy(state: Any, given: Mapping[str, Any] | None = None, _path: tuple = ()) -> Any:
    """A copy of a state dict in host memory that training cannot change: every tensor copied
    to the CPU (a DTensor keeps its mesh, placements and global shape around its copied local
    tensor), everything else deep-copied. What an async save writes once the call returns; held
    by the save alone, so it is freed when written. `given`: values taken as they are at those
    dotted keys (`model.<name>`), staged by their owner (packed.PackedSavePlanner.stage)."""
    if given and _path and ".".join(map(str, _path)) in given:
        return given[".".join(map(str, _path))]
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: host_copy(v, given, (*_path, k)) for k, v in state.items()}
    if isinstance(state, list):
        return [host_copy(v, given, (*_path, i)) for i, v in enumerate(state)]
    if isinstance(state, tuple):
        return tuple(host_copy(v, given, (*_path, i)) for i, v in enumerate(state))
    return copy.deepcopy(state)


_SAVES: Slot[AsyncSaves] = Slot("async checkpoint saves", make=AsyncSaves, close=AsyncSaves.close)


def saves() -> AsyncSaves:
    """The open session's AsyncSaves (outside a session, the process's), made on first use."""
    return _SAVES.get()


def wait() -> None:
    """Finish a pending async save (collective when one is pending); re-raise its error.
    The open session's save (outside a session, the process's)."""
    jobs = _SAVES.peek()
    if jobs is not None:
        jobs.wait()
