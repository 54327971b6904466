"""Which run a checkpoint belongs to: the run id that saves record and `latest()` filters by.

Every commit marker (and every partial folder's `smp_partial.json`) carries the id of the run
that wrote it. A save never replaces a checkpoint, or a partial folder, of another run;
`keep_last` deletes only this run's; `latest(root)` returns this run's newest (another run's
only when asked: `run="any"`, or `run="<id>"`, e.g. a fine-tune starting from a pretraining run).

Where this run's id comes from, first match:
  1. `SMP_RUN_ID` (environment): the user's name for the run. Set the same value when
     resubmitting a job that must continue the same run (a new `sbatch`, a new torchrun launch);
  2. `TORCHELASTIC_RUN_ID`, which torchrun sets on every rank: the same for every restart
     attempt of one launch (`--max-restarts`), so a restarted attempt finds its checkpoints;
     `--standalone` makes a new one per launch ("none", torchrun's placeholder, is ignored);
  3. otherwise none is known. A process that loads a checkpoint before it saves one continues
     that checkpoint's run (its id is taken over); one that saves first makes a new id (rank 0's,
     shared with every rank). Until either happens, `latest(root)` returns the newest checkpoint
     when the root holds one run's checkpoints only (a restarted script of an unnamed run) and
     refuses to guess when it holds several runs'.
An id from 1 or 2 never changes: loading another run's checkpoint does not make this run that
one. The id is owned by the session (`smp.init` .. `smp.shutdown`), or by the process outside one.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from smp.scope import Slot

RUN_ID_ENV = "SMP_RUN_ID"
TORCHRUN_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


@dataclass
class RunId:
    id: str
    source: str  # "SMP_RUN_ID", "torchrun", "made" (by this run's first save), "taken over" (a load)


_RUN = Slot("checkpoint run id")


def from_environment() -> RunId | None:
    """The run id the environment gives (SMP_RUN_ID, then torchrun's), or None."""
    named = os.environ.get(RUN_ID_ENV, "").strip()
    if named:
        return RunId(named, RUN_ID_ENV)
    torchrun = os.environ.get(TORCHRUN_RUN_ID_ENV, "").strip()
    if torchrun and torchrun.lower() != "none":
        return RunId(torchrun, "torchrun")
    return None


def known() -> RunId | None:
    """This run's id when it is known (the environment's, made by a save, taken over by a
    load); None for a process that has neither saved nor loaded and has no id from outside."""
    held = _RUN.peek()
    if held is None:
        held = from_environment()
        if held is not None:
            _RUN.set(held)
    return held


def current() -> str:
    """This run's id, made now if none is known. Collective under torch.distributed when it is
    made (rank 0's id goes to every rank): call it on every rank, outside rank-0-only code."""
    held = known()
    if held is not None:
        return held.id
    box = [uuid.uuid4().hex[:16]]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    _RUN.set(RunId(box[0], "made"))
    return box[0]


def take_over(saved_run_id: object) -> None:
    """After loading a checkpoint: a process without an id continues that checkpoint's run
    (keep_last may then delete its older checkpoints and the partial folders its killed saves
    left). An id that is already known stays."""
    if known() is None and isinstance(saved_run_id, str) and saved_run_id:
        _RUN.set(RunId(saved_run_id, "taken over"))
