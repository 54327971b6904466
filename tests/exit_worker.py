"""A few training steps on 2 gloo ranks, then smp.shutdown(): the smallest run that exercises
everything alive at exit (mesh groups, FSDP, step_guard's watchdog, a checkpoint save, the
metrics writer). tests/test_exit.py and bench/exit_loop.py run it many times; every run must
exit 0 on every rank.

    torchrun --standalone --nproc-per-node 2 tests/exit_worker.py OUT_DIR [--async-save]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

import smp
from smp import metrics
from smp.testing.models import TinyTransformer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--async-save", action="store_true")
    args = ap.parse_args()
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


def run_torchrun(out_dir: str, async_save: bool = False, timeout: float = 300.0) -> tuple[int, str]:
    """Run this script on 2 ranks under torchrun: (torchrun's exit status, its output); -9 when
    it was killed at `timeout`."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, out_dir, *(["--async-save"] if async_save else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("SMP_CONFIG", None)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return -9, str(e.stdout or "") + str(e.stderr or "")
    return proc.returncode, proc.stdout + proc.stderr


if __name__ == "__main__":
    main()
