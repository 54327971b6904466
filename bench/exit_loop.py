"""Run tests/core/exit_worker.py (2 gloo ranks under torchrun, a few steps, smp.shutdown) N times in
a row and count the runs that did not exit 0, e.g. a rank aborted at exit with `terminate
called without an active exception`. Prints one JSON line: runs, failures, seconds; the log of
each failed run goes to --logs.

    python bench/exit_loop.py --runs 100 [--async-save] [--logs DIR]
    python bench/exit_loop.py --runs 100 --trainer example     # examples/finetune_trainer.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.core.exit_worker import run_torchrun, threads_at_exit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--logs", default=tempfile.gettempdir())
    ap.add_argument("--trainer", choices=("example", "sft"), help="run a Trainer script instead")
    args = ap.parse_args()
    failures = []
    start = time.monotonic()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as out_dir:
            code, text = run_torchrun(out_dir, args.async_save, args.timeout, trainer=args.trainer)
        if code != 0 or "terminate called" in text or threads_at_exit(text) != {0: 0, 1: 0}:
            log = os.path.join(args.logs, f"exit_loop_run{i}.log")
            with open(log, "w") as f:
                f.write(text)
            failures.append({"run": i, "exit": code, "log": log})
        print(f"run {i}: exit {code} ({len(failures)} failed so far)", file=sys.stderr, flush=True)
    print(json.dumps({"runs": args.runs, "failures": len(failures), "seconds": round(time.monotonic() - start),
                      "failed": failures}))


if __name__ == "__main__":
    main()
