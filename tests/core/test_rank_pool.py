"""The test harness itself: a pool whose workers collect too many threads is restarted; a rank
that dies says how."""

from __future__ import annotations

import os

import pytest

from smp.testing import rank_pool


def _pid() -> int:
    return os.getpid()


def _segfault() -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0: a native crash, like a gloo worker thread's


def test_pool_restarts_thread_heavy_workers_and_says_how_a_rank_died(monkeypatch):
    """One pool: restarted when its workers collect too many threads; then a rank killed by a
    native crash, which used to be reported as "rank 0 died" and nothing else (a segfault prints
    nothing by itself): the error names the signal and, from faulthandler's dump, where the
    crashing thread was."""
    pool = rank_pool.RankPool(1)
    try:
        first = pool.run(_pid)
        assert pool.run(_pid) == first  # reused while under the limit
        monkeypatch.setattr(rank_pool, "MAX_WORKER_THREADS", 0)
        assert pool.run(_pid) != first  # over the limit: fresh workers
        monkeypatch.setattr(rank_pool, "MAX_WORKER_THREADS", 400)
        with pytest.raises(rank_pool.RankFailure) as died:
            pool.run(_segfault)
        assert "rank 0 died during tests.core.test_rank_pool._segfault (killed by signal 11, SIGSEGV; in " in str(died.value)
        assert "_segfault (test_rank_pool.py:" in str(died.value), died.value
    finally:
        pool.close()
