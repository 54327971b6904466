"""The test harness itself: a pool whose workers collect too many threads is restarted."""

from __future__ import annotations

import os

from smp.testing import rank_pool


def _pid() -> int:
    return os.getpid()


def test_pool_restarts_when_workers_collect_threads(monkeypatch):
    pool = rank_pool.RankPool(1)
    try:
        first = pool.run(_pid)
        assert pool.run(_pid) == first  # reused while under the limit
        monkeypatch.setattr(rank_pool, "MAX_WORKER_THREADS", 0)
        assert pool.run(_pid) != first  # over the limit: fresh workers
    finally:
        pool.close()
