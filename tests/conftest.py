"""Shared fixtures: one pool of gloo ranks per world size, alive for the whole session."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors in tests. Set before anything imports triton: triton reads
# it when it loads, and importing smp (through torch._dynamo) already does.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from smp.testing.rank_pool import RankPool  # noqa: E402

_POOLS: dict[int, RankPool] = {}


def pytest_configure(config: pytest.Config) -> None:
    # smp's own warnings are errors (pyproject.toml's filterwarnings holds the rest of the list).
    config.addinivalue_line("filterwarnings", "error::smp.errors.SMPWarning")


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


def pytest_collection_modifyitems(config, items):
    """`pytest` with no `-m` and no test named by id runs the default suite: the slow cases
    (whole-script launches, installs, world 4-8 compositions) are left to `bash scripts/test.sh`
    (the whole suite, which CI runs) or `-m "slow or not slow"`. The long cases (training effect
    over hundreds of steps, world-8 repeats of a world-4 proof, a second install path) are skipped
    unless selected: `bash scripts/test.sh -m long`. A case named by id always runs."""
    named = any("::" in str(arg) for arg in config.args)
    if not named and "long" not in (config.option.markexpr or ""):
        skip = pytest.mark.skip(reason="long: runs only when selected (bash scripts/test.sh -m long)")
        for item in items:
            if item.get_closest_marker("long"):
                item.add_marker(skip)
    if config.option.markexpr or named:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
