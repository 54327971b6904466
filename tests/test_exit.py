"""Clean exit: a finished 2-rank gloo run exits 0 on every rank, run after run.

About 1 run in 12 of a finished example used to end with `terminate called without an active
exception` (SIGABRT) on one rank, so torchrun reported a failure after a good run. One run
proves nothing; this runs tests/exit_worker.py (init, FSDP, step_guard, a checkpoint, the
metrics writer, smp.shutdown) RUNS times under torchrun. bench/exit_loop.py runs it 100 times.
"""

from __future__ import annotations

import os

import pytest

from tests.exit_worker import run_torchrun

# ~15 s per run on an idle 2-core machine, and the abort is not fixed yet (about 1 run in 40 on
# gloo; see docs/reliability.md): opt in with SMP_EXIT_RUNS=N rather than make CI flaky.
RUNS = int(os.environ.get("SMP_EXIT_RUNS", "0"))


@pytest.mark.slow
@pytest.mark.skipif(RUNS < 1, reason="opt-in: SMP_EXIT_RUNS=20 pytest tests/test_exit.py (the gloo exit abort is still open)")
def test_repeated_runs_exit_cleanly(tmp_path):
    failed = []
    for i in range(RUNS):
        out_dir = tmp_path / f"run{i}"
        out_dir.mkdir()
        code, text = run_torchrun(str(out_dir), async_save=i % 2 == 1, timeout=300)
        if code != 0 or "terminate called" in text:
            failed.append(f"--- run {i}: exit {code}\n{text[-2000:]}")
    assert not failed, f"{len(failed)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(failed)
