"""A tiny smp training script that fails on purpose, for tests/reliability/test_reliability.py.

Run one process per rank (torchrun, or the test's own launcher with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set). On rank --fail-rank at step --fail-step, between forward and
backward (mid-step), it does --mode:
  raise  - raises ValueError          exit  - os._exit(7) (dies without a Python error)
  hang   - sleeps forever             ok    - nothing (a clean run)
  kill   - SIGKILLs itself (as the OOM killer would)
  stop   - SIGSTOPs itself (frozen until someone sends SIGCONT)
  chained - raises RuntimeError("[Stage 1] failed to run forward:" ...) from a ValueError, as
           torch's pipeline stage wraps a stage's error
  setup  - raises ValueError before its first step_guard (the others are already in step 0)
With --ckpt DIR it saves a checkpoint after every step and resumes from the latest one at start;
the failure then happens only on the first attempt (torchrun --max-restarts restarts it).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time

import torch

import smp
from smp.testing.models import TinyTransformer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["raise", "exit", "hang", "ok", "kill", "stop", "chained", "setup"], default="ok")
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--fail-step", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    smp.init({"backend": "gloo", "collective_timeout_seconds": args.timeout, "random_seed": 0})
    rank = smp.state.rank
    model = smp.transform(TinyTransformer(vocab=64, dim=32, hidden=64, layers=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.mode == "setup" and rank == args.fail_rank:
        raise ValueError(f"injected setup failure on rank {rank}")

    start = 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.ckpt:
        path = smp.checkpointing.latest(args.ckpt)
        if path is not None:
            extra = smp.checkpointing.load(path, model, opt)
            start = int(extra["step"]) + 1
            print(f"rank {rank} attempt {attempt} resumed from {os.path.basename(str(path))} step {extra['step']}", flush=True)

    gen = torch.Generator().manual_seed(1234)
    for step in range(args.steps):
        ids = torch.randint(0, 64, (2, 16), generator=gen)  # same data stream on every attempt
        if step < start:
            continue
        guard = smp.step_guard(step) if not args.no_guard else _nullcontext()
        with guard:
            loss = model(ids, labels=ids)
            if rank == args.fail_rank and step == args.fail_step and attempt == 0:
                _fail(args.mode, rank, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
        print(f"rank {rank} attempt {attempt} step {step} loss {loss.item():.6f}", flush=True)
        if args.ckpt:
            smp.checkpointing.save(os.path.join(args.ckpt, f"step_{step:05d}"), model, opt, extra={"step": step})
    smp.shutdown()
    print(f"rank {rank} done", flush=True)


def _fail(mode: str, rank: int, step: int) -> None:
    if mode == "raise":
        raise ValueError(f"injected failure on rank {rank} at step {step}")
    if mode == "chained":
        try:
            raise ValueError(f"injected failure on rank {rank} at step {step}")
        except ValueError as e:
            raise RuntimeError(f"\n    [Stage {rank}] failed to run forward:\n    args: ('Tensor(...)',)\n") from e
    if mode == "exit":
        sys.stdout.flush()
        os._exit(7)
    if mode == "hang":
        time.sleep(3600)
    if mode in ("kill", "stop"):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    # A worker never outlives this, and shows where it was if it had to stop this way. (Not set
    # when a test calls main() in its own process: --mode ok at world 1, the uninterrupted run.)
    faulthandler.dump_traceback_later(float(os.environ.get("SMP_TEST_WORKER_LIMIT", "240")), exit=True)
    main()
