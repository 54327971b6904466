"""`Checkpointer`: the common checkpoint loop in three calls, on top of save / load / latest.

    ckpt = smp.checkpointing.Checkpointer("ckpt", model, optimizer, scheduler=sched, keep_last=3)
    start = ckpt.resume()          # 0 on a fresh run, else the step of the latest checkpoint
    for step in range(start, total_steps):
        ...
        ckpt.maybe_save(step + 1)  # with every=N; or ckpt.save(step + 1) where you choose
    ckpt.wait()

Each save writes `<root>/step_<step>` through `smp.checkpointing.save`, with every named stateful's
`state_dict()` in `extra` next to the step; `resume` loads the newest complete checkpoint of this
run under `root` through `smp.checkpointing.latest` and `load`, and hands each stateful its state
back. Nothing new underneath: a Checkpointer's folders are ordinary checkpoints.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from smp.checkpointing import api, sharded  # the public save (reads smp's run), load, wait
from smp.checkpointing.commit import atomic
from smp.errors import CheckpointError

log = logging.getLogger(__name__)

# Keys of a checkpoint that a stateful's name would collide with: DCP's model and optimizer
# state, and the step a Checkpointer records in `extra`.
RESERVED = ("model", "optim", "step")


class Checkpointer:
    """Saves and resumes `model`, `optimizer` and every named stateful under `root`.

    `**stateful`: objects with `state_dict()` and `load_state_dict()` (a scheduler, a
    StatefulDataLoader, a gradient scaler), saved under their keyword. `keep_last`, `async_save`:
    as in `smp.checkpointing.save`. `every`: `maybe_save(step)` saves when `step` is a multiple of
    it. Every method is collective: call it on every rank."""

    def __init__(
        self,
        root: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        every: int | None = None,
        **stateful: Any,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least 1 checkpoint, or pass None to keep all")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise CheckpointError(f"every={every!r}: pass a whole number of steps >= 1, or None to save only "
                                  f"when you call save(step)")
        for name, value in stateful.items():
            if name in RESERVED:
                raise CheckpointError(
                    f"Checkpointer: the keyword `{name}=` is reserved (a checkpoint already holds "
                    f"{', '.join(RESERVED)}); pass that object under another name, e.g. `my_{name}=`")
            lacking = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(value, m, None))]
            if lacking:
                raise CheckpointError(
                    f"Checkpointer: `{name}=` ({type(value).__name__}) has no {' or '.join(f'{m}()' for m in lacking)}; "
                    f"every keyword besides keep_last, async_save and every must be an object with state_dict() "
                    f"and load_state_dict() (a scheduler, a StatefulDataLoader). Give `{name}` those two methods, "
                    f"or save a plain value yourself with smp.checkpointing.save(..., extra=...)")
        self.root = os.fspath(root)
        self.model, self.optimizer = model, optimizer
        self.keep_last, self.async_save, self.every = keep_last, async_save, every
        self.stateful = dict(stateful)

    def path(self, step: int) -> str:
        """The folder the checkpoint of `step` goes to."""
        return os.path.join(self.root, f"step_{step}")

    def save(self, step: int) -> str:
        """Save the checkpoint of `step` (with async_save, return once it is copied to host
        memory); returns its folder. Collective."""
        extra = {"step": step, **{name: obj.state_dict() for name, obj in self.stateful.items()}}
        path = self.path(step)
        api.save(path, self.model, self.optimizer, extra=extra, async_save=self.async_save,
                           keep_last=self.keep_last)
        return path

    def maybe_save(self, step: int) -> bool:
        """Save when `every` was given and `step` is a multiple of it; whether it saved. Collective."""
        if self.every is None or step % self.every:
            return False
        self.save(step)
        return True

    def resume(self, *, allow_pickle: bool = False) -> int:
        """Load the newest complete checkpoint of this run under `root` into the model, the
        optimizer and every stateful; return its step (0, with nothing changed, when there is
        none). `allow_pickle` as in `smp.checkpointing.load`. Collective."""
        path = atomic.latest(self.root)
        if path is None:
            return 0
        extra = sharded.load(path, self.model, self.optimizer, allow_pickle=allow_pickle)
        if not isinstance(extra, dict) or not isinstance(extra.get("step"), int):
            raise CheckpointError(
                f"{path!r} was not saved by a Checkpointer (its `extra` holds no step); the model and "
                f"optimizer were loaded from it, nothing else. Load it with smp.checkpointing.load and "
                f"restore the rest yourself")
        missing = sorted(name for name in self.stateful if name not in extra)
        if missing:
            raise CheckpointError(
                f"{path!r} holds no state for {', '.join(f'`{n}`' for n in missing)} (it holds "
                f"{', '.join(sorted(k for k in extra if k != 'step')) or 'none'}); the model and optimizer were "
                f"loaded from it, no stateful was. Pass the stateful keywords the run was saved with")
        for name, obj in self.stateful.items():
            obj.load_state_dict(extra[name])
        ignored = sorted(k for k in extra if k != "step" and k not in self.stateful)
        if ignored:
            log.warning("smp.checkpointing.Checkpointer: %r also holds state for %s, which this Checkpointer "
                        "was not given; not restored", path, ", ".join(ignored))
        return extra["step"]

    def wait(self) -> None:
        """Finish a pending async save (collective when one is pending); re-raise its error."""
        sharded.wait()
