"""Byte counters: what this rank put on the wire, per algorithm and collective.

Every collective in smp_collectives records the bytes *this rank sends* (its own chunk to itself
is not counted) and one call. Counters are per process (= per rank) and cumulative until
`reset()`; read them once per training step for bytes-per-rank-per-step:

    smp_collectives.counters.reset()
    loss.backward(); opt.step()
    sent = smp_collectives.counters.bytes_sent()          # total
    table = smp_collectives.counters.snapshot()           # {"int8.reduce_scatter": {...}, ...}
"""

from __future__ import annotations

import threading
from collections import defaultdict

_LOCK = threading.Lock()
_BYTES: dict[str, int] = defaultdict(int)
_CALLS: dict[str, int] = defaultdict(int)


def record(name: str, nbytes: int) -> None:
    """Add one call of collective `name` (e.g. "ring.reduce_scatter") that sent `nbytes`."""
    with _LOCK:
        _BYTES[name] += int(nbytes)
        _CALLS[name] += 1


def reset() -> None:
    with _LOCK:
        _BYTES.clear()
        _CALLS.clear()


def bytes_sent(prefix: str = "") -> int:
    """Bytes sent by this rank since the last reset, over the collectives whose name starts with `prefix`."""
    with _LOCK:
        return sum(v for k, v in _BYTES.items() if k.startswith(prefix))


def snapshot() -> dict[str, dict[str, int]]:
    """{collective name: {"bytes": ..., "calls": ...}} since the last reset."""
    with _LOCK:
        return {k: {"bytes": _BYTES[k], "calls": _CALLS[k]} for k in sorted(_BYTES)}
