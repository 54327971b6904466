"""What a run owns lives in a scope, not in module globals (see smp/runtime.py).

A module that keeps state for a run (an async save in flight, the context-parallel setup, the
watchdog, a patch of another library) declares one `Slot` for it at import; declaring allocates
nothing and registers nothing:

    _SAVES = Slot("async checkpoint saves", make=AsyncSaves, close=AsyncSaves.close)

and reaches its object through the slot: `_SAVES.get()` (made by `make` on first use),
`_SAVES.peek()` (None when there is none), `_SAVES.set(obj)`, `_SAVES.clear()`. The object lives
in the scope open at that moment: the session's, between `smp.init` and `smp.shutdown`, or
outside any session (plain torch.distributed, `smp plan`) the process's own. Closing a scope
calls each slot's `close(obj)` on its object, newest first, and forgets them all, so the next
session starts with none: two sessions in one process never see each other's objects.

This module imports nothing of smp's, so that any layer can declare a slot without an import
cycle; smp/runtime.py opens and closes session scopes, and `isolated` gives a run inside the
process (`smp plan`'s fake world) a scope of its own.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Generic, Iterator, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Slot(Generic[T]):
    """One kind of object a scope can own. `make()` builds it on first `get()`; `close(obj)`
    (optional) releases it when its scope closes, while the process group still works; it
    should not raise (an error is logged and the other objects still close)."""

    def __init__(self, name: str, make: Callable[[], T] | None = None,
                 close: Callable[[T], None] | None = None) -> None:
        self.name, self.make, self.close = name, make, close

    def get(self) -> T:
        scope = current()
        if self not in scope.objects:
            if self.make is None:
                raise RuntimeError(f"{self.name}: nothing set in the {scope.name} scope")
            scope.objects[self] = self.make()
        return scope.objects[self]

    def peek(self) -> T | None:
        return current().objects.get(self)

    def set(self, obj: T) -> None:
        """Own `obj` in the current scope (replacing, without closing, what was there)."""
        objects = current().objects
        objects.pop(self, None)  # re-inserted last: closed in the order of the latest set
        objects[self] = obj

    def clear(self) -> T | None:
        """Forget this slot's object in the current scope (without closing it); returns it."""
        return current().objects.pop(self, None)

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class Scope:
    """The objects one session (or, outside sessions, the process) owns, by slot."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.objects: dict[Slot, Any] = {}  # in order of creation

    def close(self) -> None:
        """Close every object, newest first, then forget them all."""
        while self.objects:
            slot, obj = self.objects.popitem()
            if slot.close is None:
                continue
            try:
                slot.close(obj)
            except Exception as e:  # noqa: BLE001 - the others must still close
                log.error("smp: closing %s of the %s scope failed: %s: %s", slot.name, self.name,
                          type(e).__name__, e)


_PROCESS = Scope("process")
_SESSIONS: list[Scope] = []  # open scopes, innermost last: the session's, and `isolated` ones


def current() -> Scope:
    """The open session's scope, else the process's."""
    return _SESSIONS[-1] if _SESSIONS else _PROCESS


def process() -> Scope:
    return _PROCESS


def open_session(name: str = "session") -> Scope:
    """smp.init: a new, empty scope that owns what the run makes until `close_session`."""
    scope = Scope(name)
    _SESSIONS.append(scope)
    return scope


def close_session(scope: Scope) -> None:
    """smp.shutdown: close `scope`'s objects (newest first) and leave it."""
    try:
        scope.close()
    finally:
        if scope in _SESSIONS:
            _SESSIONS.remove(scope)


@contextlib.contextmanager
def isolated(name: str) -> Iterator[Scope]:
    """A scope of its own for the block, closed at its end: what the block makes is neither
    seen by nor left in the scope around it (`smp plan` runs smp's recipe in a fake world inside
    whatever session the caller has open)."""
    scope = open_session(name)
    try:
        yield scope
    finally:
        close_session(scope)
