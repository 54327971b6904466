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

Every rank must name the same run: an id that differs between ranks (`$(date +%s)` evaluated per
node, or set on one rank only) let each rank's `latest()` pick another checkpoint, and the ranks
parted ways until the collective timeout. So the ranks compare their ids (`agree`) at `smp.init`,
and under plain torch.distributed at the first save, and a difference is a ConfigError on every
rank naming the values. An id is at most `MAX_RUN_ID_CHARS` long: every commit marker carries it,
and a marker is read with a bound (a 70 KB id made this run's checkpoints unreadable to `latest`).
Messages quote an id through `short` (at most ~100 characters).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from smp.errors import ConfigError
from smp.scope import Slot

RUN_ID_ENV = "SMP_RUN_ID"
TORCHRUN_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
# Longest id accepted (a job name, a UUID, a Slurm or Kubernetes id fit many times over); the
# commit marker that carries it is read with a 64 KiB bound (atomic._MAX_MARKER_BYTES).
MAX_RUN_ID_CHARS = 256
_QUOTED_CHARS = 80


@dataclass
class RunId:
    id: str
    source: str  # "SMP_RUN_ID", "torchrun", "made" (by this run's first save), "taken over" (a load)
    agreed: bool = False  # every rank was found to hold the same id (`agree`)


def short(run_id: object) -> str:
    """A run id quoted for a message: whole when short, else its start and its length."""
    text = str(run_id)
    return text if len(text) <= _QUOTED_CHARS + 20 else f"{text[:_QUOTED_CHARS]}... ({len(text)} characters)"


_RUN = Slot("checkpoint run id")


def from_environment() -> RunId | None:
    """The run id the environment gives (SMP_RUN_ID, then torchrun's), or None."""
    named = os.environ.get(RUN_ID_ENV, "").strip()
    if named:
        return RunId(_bounded(named, RUN_ID_ENV), RUN_ID_ENV)
    torchrun = os.environ.get(TORCHRUN_RUN_ID_ENV, "").strip()
    if torchrun and torchrun.lower() != "none":
        return RunId(_bounded(torchrun, TORCHRUN_RUN_ID_ENV), "torchrun")
    return None


def _bounded(value: str, variable: str) -> str:
    if len(value) > MAX_RUN_ID_CHARS:
        raise ConfigError(
            f"{variable} is {len(value)} characters long ({short(value)}); a run id is at most "
            f"{MAX_RUN_ID_CHARS} (every checkpoint's commit marker carries it). Set {RUN_ID_ENV} to a short "
            f"name for the run, e.g. the job id"
        )
    return value


def agree() -> None:
    """Collective (every rank): raise ConfigError on every rank when the ranks' run ids from the
    environment differ (or one is not acceptable). A no-op without torch.distributed."""
    try:
        mine, problem = from_environment(), None
    except ConfigError as e:  # reported by every rank below: none may leave the others waiting
        mine, problem = None, str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        told: list = [None] * dist.get_world_size()
        dist.all_gather_object(told, (None if mine is None else mine.id, problem))
    else:
        told = [(None if mine is None else mine.id, problem)]
    problems = [(rank, p) for rank, (_, p) in enumerate(told) if p]
    if problems:
        rank, first = problems[0]
        raise ConfigError(first if rank == 0 or len(problems) == len(told) else f"on rank {rank}: {first}")
    ids = [i for i, _ in told]
    if len(set(ids)) > 1:
        raise ConfigError(_differ(ids))
    if mine is not None:
        _RUN.set(RunId(mine.id, mine.source, agreed=True))


def _differ(ids: list[str | None]) -> str:
    first_rank: dict[str | None, int] = {}
    for rank, run_id in enumerate(ids):
        first_rank.setdefault(run_id, rank)
    shown = ", ".join(f"rank {rank}: {'none' if run_id is None else repr(short(run_id))}"
                      for run_id, rank in list(first_rank.items())[:3])
    more = f" and {len(first_rank) - 3} more" if len(first_rank) > 3 else ""
    return (f"the ranks name different runs ({RUN_ID_ENV}, else {TORCHRUN_RUN_ID_ENV}): {shown}{more}; every "
            f"rank must have the same id, or each rank's latest() picks another checkpoint. Set {RUN_ID_ENV} "
            f"once for the whole job, before the launcher (e.g. export {RUN_ID_ENV}=$SLURM_JOB_ID), not per "
            f"node or per rank (a $(date +%s) per node differs)")


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
    """This run's id, made now if none is known. Collective under torch.distributed until the
    ranks have agreed on it (an id from the environment is compared; a made one is rank 0's, sent
    to every rank): call it on every rank, outside rank-0-only code."""
    held = _RUN.peek()
    if held is None or (not held.agreed and held.source in (RUN_ID_ENV, "torchrun")):
        agree()  # every rank: under plain torch.distributed this is the first save (smp.init agreed already)
        held = _RUN.peek()
    if held is not None:
        return held.id
    box = [uuid.uuid4().hex[:16]]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    _RUN.set(RunId(box[0], "made", agreed=True))
    return box[0]


def take_over(saved_run_id: object) -> None:
    """After loading a checkpoint: a process without an id continues that checkpoint's run
    (keep_last may then delete its older checkpoints and the partial folders its killed saves
    left). An id that is already known stays."""
    if known() is None and isinstance(saved_run_id, str) and saved_run_id:
        _RUN.set(RunId(saved_run_id, "taken over"))
