"""Crash-during-save trials, run as `python -m tests.reliability.reliability_crash_trials ROOT --trials N`.

One process imports torch once, then per trial forks a child that saves checkpoint k of a tiny
model (parameters filled with values that encode k) and SIGKILLs it: at a named phase of the
save (the child kills itself there) or after a random delay (the parent kills it). After every
kill, `latest(ROOT)` must be a committed checkpoint that loads and holds exactly the values of
the step it claims: the previous one, or the new one when the kill came after its commit.
Prints one JSON line: per-trial outcomes. A separate process, so that fork never happens in
the test runner (threads, OpenMP).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import time

import torch

from smp import checkpointing
from smp.checkpointing import sharded
from smp.checkpointing.commit import atomic
from smp.checkpointing.format import metadata
from smp.testing.models import TinyTransformer

# Where a child kills itself: the function it dies entering (module, attribute).
PHASES = {
    "before_shards": (sharded.dcp, "save"),  # only smp_extra/ written
    "before_meta": (metadata, "write"),  # shards written, no smp_meta.json
    "before_commit_marker": (atomic, "commit"),  # meta written, no marker
    "before_rename": (os, "rename"),  # marker written, still .partial
    "during_keep_last": (shutil, "rmtree"),  # committed; deleting the oldest (storage.remove_tree)
}
KEEP_LAST = 3


def _fill(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(step + i / 1000.0)


def _holds_step(model: torch.nn.Module, step: int) -> bool:
    return all(torch.all(p == step + i / 1000.0).item() for i, p in enumerate(model.parameters()))


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _child(root: str, step: int, phase: str | None) -> None:
    model = TinyTransformer(vocab=32, dim=16, hidden=32, layers=2)
    _fill(model, step)
    if phase is not None:
        module, name = PHASES[phase]
        setattr(module, name, _die)
    checkpointing.save(os.path.join(root, f"step_{step:05d}"), model, extra={"step": step}, keep_last=KEEP_LAST)
    os._exit(0)


def _run_child(root: str, step: int, phase: str | None, delay: float | None) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            _child(root, step, phase)
        finally:
            os._exit(1)
    if delay is not None:
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed"
    return "finished" if os.WEXITSTATUS(status) == 0 else "failed"


def _check(root: str, step: int, previous: int | None) -> dict:
    path = checkpointing.latest(root)
    found = {"latest": None if path is None else os.path.basename(path)}
    if path is None:
        found["ok"] = previous is None
        return found
    model = TinyTransformer(vocab=32, dim=16, hidden=32, layers=2)
    extra = checkpointing.load(path, model)
    claimed = int(extra["step"])
    found.update(
        claimed=claimed,
        ok=claimed in (previous, step) and _holds_step(model, claimed) and atomic.is_committed(path)
        and not os.path.basename(path).startswith("."),
    )
    # Every partial directory left behind is refused by load(), never read as a checkpoint.
    for name in os.listdir(root):
        if name.endswith(atomic.PARTIAL_SUFFIX):
            try:
                checkpointing.load(os.path.join(root, name), model)
                found["ok"] = False
                found["partial_loaded"] = name
            except checkpointing.CheckpointError:
                pass
    return found


def _warm_up(scratch: str) -> None:
    model = TinyTransformer(vocab=32, dim=16, hidden=32, layers=2)
    checkpointing.save(os.path.join(scratch, "w"), model, extra={"step": -1})
    checkpointing.load(os.path.join(scratch, "w"), model)
    shutil.rmtree(scratch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)

    # Warm up in this process (lazy imports of DCP's planners and writers), so that children
    # inherit them and a save takes its steady-state time.
    _warm_up(os.path.join(args.root, ".warmup"))
    # Complete saves first: more than KEEP_LAST, so that every later save also deletes the
    # oldest; then the time a save takes, to spread the random kills over it.
    for step in range(KEEP_LAST + 1):
        assert _run_child(args.root, step, None, None) == "finished"
    t0 = time.monotonic()
    step = KEEP_LAST + 1
    assert _run_child(args.root, step, None, None) == "finished"
    duration = time.monotonic() - t0
    previous, step, trials = step, step + 1, []
    plan = [(phase, None) for phase in PHASES] + [
        (None, rng.uniform(0.0, 0.8 * duration)) for _ in range(args.trials)
    ]
    for phase, delay in plan:
        outcome = _run_child(args.root, step, phase, delay)
        found = _check(args.root, step, previous)
        trials.append({"step": step, "phase": phase, "delay": delay, "outcome": outcome, **found})
        if found.get("claimed") is not None:
            previous = found["claimed"]
        step += 1
    print(json.dumps({"save_seconds": duration, "trials": trials}))


if __name__ == "__main__":
    main()
