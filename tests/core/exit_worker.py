"""A few training steps on 2 gloo ranks, then smp.shutdown(): the smallest run that exercises
everything alive at exit (mesh groups, FSDP, step_guard's watchdog, a checkpoint save, the
metrics writer). tests/core/test_exit.py and bench/exit_loop.py run it many times; every run must
exit 0 on every rank.

    torchrun --standalone --nproc-per-node 2 tests/core/exit_worker.py OUT_DIR [--async-save] [--old-teardown]
    torchrun --standalone --nproc-per-node 2 tests/core/exit_worker.py OUT_DIR --trainer example|sft [--old-teardown]

At exit, after every other atexit handler, each rank prints how many gloo native threads are
still alive ("gloo threads at exit: N"): smp.shutdown must leave none for the interpreter's
finalization to race with (smp/reliability/teardown.py). --old-teardown turns smp's release of
the groups off (the shutdown before the fix): the negative control.

--trainer runs a Trainer script instead, in this process: `example` is
examples/finetune_trainer.py (SMPTrainer, a checkpoint every 2 steps, the final export),
`sft` is examples/finetune_sft.py (TRL's SFTTrainer through smp_trainer_class). Neither calls
smp.shutdown; the process group is accelerate's. With --old-teardown the Trainer registers no
exit handler (smp/reliability/exit.py), as before the fix.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import atexit

import torch

import smp
from smp import metrics
from smp.reliability.teardown import gloo_thread_count
from smp.testing.models import TinyTransformer
from tests import REPO_ROOT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--old-teardown", action="store_true")
    ap.add_argument("--trainer", choices=("example", "sft"))
    args = ap.parse_args()
    # Registered before smp.shutdown registers its exit handler, so it runs after it (atexit is
    # LIFO): it sees what the interpreter's finalization will find.
    atexit.register(_report_threads_at_exit)
    if args.trainer:
        _run_trainer_script(args.trainer, args.out_dir, args.steps, args.old_teardown)
        return
    if args.old_teardown:
        for name in ("forget_mesh_groups", "release_unreferenced_groups", "release_at_exit"):
            setattr(smp.runtime, name, lambda *a: None)
    torch.set_num_threads(1)
    smp.init({"backend": "gloo", "random_seed": 0})
    rank = smp.state.rank
    model = smp.transform(TinyTransformer(vocab=64, dim=32, hidden=64, layers=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = metrics.MetricsWriter(args.out_dir, enabled=rank == 0)
    gen = torch.Generator().manual_seed(1234)
    for step in range(args.steps):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        with smp.step_guard(step):
            loss = model(ids, labels=ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
        writer.write(step, {"loss": smp.training.all_reduce_mean(loss.detach())})
    smp.checkpointing.save(os.path.join(args.out_dir, f"step_{args.steps}"), model, opt,
                           async_save=args.async_save)
    writer.close()
    smp.shutdown()


def _run_trainer_script(which: str, out_dir: str, steps: int, old_teardown: bool) -> None:
    import runpy

    import smp.integrations.trainer

    if old_teardown:
        smp.integrations.trainer.end_run_at_exit = lambda *meshes: None
    root = REPO_ROOT
    script = root / "examples" / ("finetune_trainer.py" if which == "example" else "finetune_sft.py")
    sys.argv = [str(script), "--steps", str(steps), "--output-dir", out_dir,
                *(["--save-steps", "2"] if which == "example" else [])]
    runpy.run_path(str(script), run_name="__main__")


def threads_at_exit(text: str) -> dict[int, int]:
    """rank -> gloo threads it reported at exit, from a run's output."""
    return {int(r): int(n) for r, n in re.findall(r"\[exit_worker\] rank (\d+) gloo threads at exit: (\d+)", text)}


def _report_threads_at_exit() -> None:
    print(f"[exit_worker] rank {os.environ.get('RANK')} gloo threads at exit: "
          f"{gloo_thread_count()}", flush=True)


def run_torchrun(out_dir: str, async_save: bool = False, timeout: float = 300.0,
                 old_teardown: bool = False, trainer: str | None = None) -> tuple[int, str]:
    """Run this script on 2 ranks under torchrun: (torchrun's exit status, its output); -9 when
    it was killed at `timeout`."""
    root = REPO_ROOT
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, out_dir, *(["--async-save"] if async_save else []),
           *(["--old-teardown"] if old_teardown else []), *(["--trainer", trainer] if trainer else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("SMP_CONFIG", None)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return -9, str(e.stdout or "") + str(e.stderr or "")
    return proc.returncode, proc.stdout + proc.stderr


if __name__ == "__main__":
    main()
