"""Shared fixtures: one pool of gloo ranks per world size, alive for the whole session."""

from __future__ import annotations

import os

import pytest

from smp.testing.rank_pool import RankPool

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors in tests

_POOLS: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def ranks():
    """`ranks(n)` -> the RankPool of world size n (started on first use, reused after)."""
    yield _pool
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(autouse=True)
def _no_state_from_an_earlier_test(monkeypatch):
    """Each test starts without an smp session and with an empty process scope: a session left
    open by an earlier in-process test would make `smp.init` of the same config a no-op (its
    checks skipped), and what a save or load outside any session keeps in the process scope
    (the checkpoint run id it made or took over) belongs to that test's run, not the next one's."""
    import warnings

    import smp
    from smp import scope

    if smp.is_initialized():
        warnings.warn("an smp session was left open by an earlier test; closed before this one")
        smp.shutdown()
    monkeypatch.setattr(scope, "_PROCESS", scope.Scope("process"))
    yield
