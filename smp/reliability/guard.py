"""`smp.step_guard(step)`: one rank's failure stops every rank within seconds, with one message.

Without help, a rank that raises mid-step and does not exit (a non-daemon thread keeps it alive,
or the user catches the error) leaves the others blocked in their next collective until the
process-group timeout (`collective_timeout_seconds`, 10 minutes by default); a rank that hangs
outside a collective does the same. Gloo and NCCL cannot be interrupted from Python while a
collective waits, so smp propagates failures through the rendezvous store instead:

- the failing rank writes one failure record ("rank R failed at step S: error") to the store
  (first writer wins) and waits briefly for the others to acknowledge it;
- a daemon watchdog thread on every rank polls for that record and, when it appears, prints
  "rank K stopping at step S: <record>" and exits the process with `PEER_FAILURE_EXIT_CODE`;
- when a collective fails or times out and no rank has reported, the rank that saw it takes a
  census (smp/reliability/census.py), so that the record names the ranks that are gone, frozen
  or stuck outside a collective rather than the innocent rank that noticed;
- when the store itself is gone, its host (rank 0, or the torchrun agent) died: a rank whose
  collective failed then says so in one line and exits as a stopped rank, blaming nobody else;
- stopped ranks exit after the failing rank, so that a launcher that names the first process
  to exit (torchrun's "Root Cause") names the failing one.

The cost is one store read per rank every `POLL_SECONDS` (no per-step traffic).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

from smp._compat import default_store
from smp.errors import CheckpointError, ConfigError, PeerFailure, PlanError
from smp.reliability.census import answer_census, local_pid, process_state, publish_process, take_census
from smp.reliability.finite import NonFiniteGradientError
from smp.scope import Slot

logger = logging.getLogger("smp.reliability")

# Exit status of a rank stopped because another rank failed: tells it apart, in the launcher's
# summary, from the rank whose own error started it (that one exits with its traceback, status 1).
PEER_FAILURE_EXIT_CODE = 3
# Watchdog poll period: how long at most before the other ranks see a failure record.
POLL_SECONDS = 0.5
# How long the failing rank waits for every other rank to acknowledge its record before
# re-raising (a rank that is dead never answers; the wait is bounded).
ACK_TIMEOUT_SECONDS = 5.0
# How long a stopped rank waits, at most, for the failing rank to exit first. torchrun names as
# "Root Cause" the rank whose failure it saw first (it polls every 0.1 s); a stopped rank that
# exited before the failing one would be named instead.
EXIT_ORDER_SECONDS = ACK_TIMEOUT_SECONDS + 5.0
# After the failing rank exited: time for the launcher to notice it before this rank exits.
EXIT_GAP_SECONDS = 0.5
# How long rank 0, when it hosts the store, stays after the release for every rank the record
# expects to have read it: a rank still setting up (a loaded machine) reaches the record late,
# and a store gone by then would make it blame rank 0 instead of the failing rank.
STORE_HOST_LINGER_SECONDS = 20.0

# Store keys live under smp/reliability/<torchrun restart>/<process group generation>/: the
# store can outlive a worker group (torchrun --standalone keeps it across --max-restarts), and
# a failure record of the previous attempt must not stop the next one.
FAILURE_KEY = "failure"
_ACK_KEY = "acks"
_RELEASE_KEY = "released"
_FAILING_RANK_KEY = "failing_rank"
_EXPECTED_ACKS_KEY = "expected_acks"

# Errors every rank raises alike (a NaN check, a checkpoint, config or plan error): each rank
# can catch its own; no rank is to blame or to be stopped.
_AGREED_ERRORS = (PeerFailure, ConfigError, CheckpointError, PlanError, NonFiniteGradientError)

# gloo raises a plain RuntimeError, not a torch.distributed.DistError, when a peer's connection
# closes ("[.../gloo/transport/tcp/pair.cc] Connection closed by peer") or a collective times out
# ("[.../gloo/transport/tcp/unbound_buffer.cc] Timed out waiting 8000ms for recv operation"), so
# those are recognised by their text. NCCL raises DistBackendError for its errors and timeouts.
_PLAIN_RUNTIME_ERROR_TEXT = ("gloo", "NCCL", "Connection closed by peer", "Connection reset", "Timed out")


class _Watch:
    """What step_guard (main thread) and the watchdog thread share: one per session
    (smp/scope.py), so smp.shutdown stops the thread before the store it polls goes."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.handling = False  # the main thread is reporting its own failure
        self.thread: threading.Thread | None = None
        self.store: dist.Store | None = None
        self.pg_id: int | None = None  # id() of the process group watched
        self.stop = threading.Event()
        # pid of the store's host (rank 0) when it runs on this host: once it is dead, no store
        # call is made (each would fail, and torch logs every failure with a C++ stack dump).
        self.store_host_pid: int | None = None
        self._stop_line = threading.Lock()  # the "stopping" line: printed once per rank
        self.stop_line_printed = False
        # The failure record the watchdog read: once this rank has acknowledged it, the store's
        # host may exit (it waits for every acknowledgement only), and a collective failing here
        # afterwards must still name the failing rank, not the store's host.
        self.record: str | None = None

    def claim_stop_line(self) -> bool:
        """True the first time only: the main thread and the watchdog may both reach the stop."""
        with self._stop_line:
            first, self.stop_line_printed = not self.stop_line_printed, True
            return first

    def stop_thread(self) -> None:
        self.stop.set()
        thread, self.thread = self.thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * POLL_SECONDS)
        self.store, self.pg_id = None, None
        atexit.unregister(self.stop_thread)


_WATCH: Slot[_Watch] = Slot("step_guard watchdog", make=_Watch, close=_Watch.stop_thread)
# Numbers the process groups watched in this process, for their store prefix: every rank watches
# the same groups in the same order, so every rank draws the same number (an id allocator, not
# run state: a new session must not reuse a prefix whose failure record may still be there).
_GENERATION = itertools.count(1)


class _StoreHostDied(Exception):
    pass


def _raise_if_store_host_died(watch: _Watch) -> None:
    if _store_host_died(watch):
        raise _StoreHostDied()


def _store_host_died(watch: _Watch) -> bool:
    """Whether the store's host is known dead (rank 0 of this host, without torchrun's store)."""
    if watch.store_host_pid is None and watch.store is not None and not _agent_hosts_store():
        try:
            watch.store_host_pid = local_pid(watch.store, 0)
        except Exception:  # noqa: BLE001 - not published yet, or the store is already gone
            return False
    return watch.store_host_pid is not None and process_state(watch.store_host_pid) in (None, "Z", "X")


def current_step() -> int | None:
    """The step of the innermost `step_guard` this session entered, or None."""
    watch = _WATCH.peek()
    return None if watch is None else watch.step


@contextmanager
def step_guard(step: int) -> Iterator[None]:
    """Run one training step so that a failure on any rank stops all ranks fast.

        for step in range(start, steps):
            with smp.step_guard(step):
                loss = model(**batch).loss
                loss.backward()
                opt.step(); opt.zero_grad()

    An exception inside the block is re-raised on this rank, with a note "rank R failed at
    step S"; every other rank prints "rank K stopping at step S: rank R failed at step S: ..."
    and exits with status `PEER_FAILURE_EXIT_CODE` within about a second. Works with any
    torch.distributed process group (smp.init's or the user's); a no-op wrapper without one.
    """
    watch = _WATCH.get()
    watch.step = step
    if dist.is_initialized() and dist.get_world_size() > 1:
        _ensure_watchdog(watch)
        if watch.store_host_pid is None:
            _store_host_died(watch)  # learns the host's pid (once published), should the watchdog be starved
    try:
        yield
    except _AGREED_ERRORS:
        raise
    except BaseException as exc:
        _handle_failure(watch, exc, step)
        raise


# ----------------------------------------------------------------------------------------------
# Errors outside every step_guard


class _UncaughtErrors:
    """The session's `sys.excepthook`: an exception that ends this process outside any step_guard
    (before the first one, or between steps) is reported to every rank as an error, like one
    inside a guard. Without it the ranks waiting in a collective took this rank for one that died
    without a Python error (killed, OOM, segfault). `close` puts the previous hook back."""

    def __init__(self) -> None:
        self.previous = sys.excepthook
        sys.excepthook = self

    def __call__(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        self.previous(exc_type, exc, tb)  # the traceback first, as always
        try:
            _report_uncaught(exc)
        except BaseException:  # noqa: BLE001 - a failing report must not hide the error above
            pass

    def close(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous


_UNCAUGHT: Slot[_UncaughtErrors] = Slot("uncaught-error report", make=_UncaughtErrors, close=_UncaughtErrors.close)


def report_uncaught_errors() -> None:
    """(smp.init) Install this session's report of errors raised outside every step_guard."""
    _UNCAUGHT.get()


def _report_uncaught(exc: BaseException) -> None:
    if isinstance(exc, (*_AGREED_ERRORS, KeyboardInterrupt)) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    watch = _WATCH.get()
    if watch.handling:
        return  # a step_guard has reported it already
    where = ("failed before its first step_guard" if watch.step is None
             else f"failed after step {watch.step}, outside step_guard")
    _handle_failure(watch, exc, watch.step, where)


# ----------------------------------------------------------------------------------------------
# Failing rank


def _handle_failure(watch: _Watch, exc: BaseException, step: int | None, where: str | None = None) -> None:
    """Report `exc` to every rank; raise PeerFailure if another rank failed first. `where`: how
    the record places the failure (default "failed at step S")."""
    where = where or f"failed at step {step}"
    if not dist.is_initialized():
        _note(exc, f"smp: {where}")
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    own = f"rank {rank} {where}: {_describe(exc)}"
    if world == 1:
        _note(exc, "smp: " + own)
        return
    _ensure_watchdog(watch)
    watch.handling = True
    store = watch.store
    alive_others = world - 1
    try:
        _raise_if_store_host_died(watch)
        record = _read_record(store)
        if record is None and _is_collective_error(exc):
            # A peer may be writing its own record right now: give it one poll period, then
            # find out who is gone or stuck, so the record does not blame this rank.
            time.sleep(POLL_SECONDS)
            _raise_if_store_host_died(watch)
            record = _read_record(store)
            if record is None:
                findings, alive_others = take_census(store, rank, world, step)
                own = f"{findings}\n(seen by rank {rank} at step {step}: a collective failed: {_describe(exc)})"
        if record is None:
            record = store.compare_set(FAILURE_KEY, "", own).decode()  # first writer wins
    except Exception as store_exc:  # noqa: BLE001 - the store host (rank 0 / launcher) is gone
        if watch.record is not None:  # the watchdog already read who failed (see _Watch.record)
            _stop_process(_stopping_message(rank, step, watch.record), watch)
        why = ("its process has exited" if isinstance(store_exc, _StoreHostDied)
               else f"the rendezvous store no longer answers: {type(store_exc).__name__}")
        if _is_collective_error(exc):
            # Both the collective and the store failed: the store's host died, and this rank's
            # peers lost it too. No rank to name but that host; this rank is not to blame.
            _stop_process(watch=watch, message=
                f"rank {rank} stopping at step {step}: {_store_host()} is gone ({why}); its log "
                f"or the launcher's has the cause. Here: {_describe(exc)[:200]}"
            )
        message = (
            f"{own}\n(the rendezvous store is unreachable too: {why}; "
            f"{_store_host()} has exited)"
        )
        _log(message)
        _note(exc, "smp: " + message)
        return
    if record != own:
        message = _stopping_message(rank, step, record)
        if watch.claim_stop_line():
            _log(message)
        _acknowledge(store, rank)
        _wait_for_failing_rank_to_exit(store)
        raise PeerFailure(message) from exc
    try:
        store.set(_EXPECTED_ACKS_KEY, str(alive_others))
        store.set(_FAILING_RANK_KEY, str(rank))
    except Exception:  # noqa: BLE001 - the store went away: nobody left to tell
        pass
    _log(own)
    _note(exc, f"smp: {own} (every rank is being stopped)")
    _wait_for_acks(store, alive_others)


def _read_record(store: dist.Store) -> str | None:
    if store.check([FAILURE_KEY]):
        return store.get(FAILURE_KEY).decode()
    return None


def _wait_for_acks(store: dist.Store, expected: int) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT_SECONDS
    try:
        while time.monotonic() < deadline and store.add(_ACK_KEY, 0) < expected:
            time.sleep(0.05)
        store.set(_RELEASE_KEY, "1")
    except Exception:  # noqa: BLE001 - the store went away: nobody left to tell
        pass


def _acknowledge(store: dist.Store, rank: int) -> None:
    try:
        # Once per rank: its watchdog and its main thread (a collective that failed meanwhile) may
        # both get here, and a double count would release the store's host before a late rank read.
        if store.add(f"{_ACK_KEY}/{rank}", 1) == 1:
            store.add(_ACK_KEY, 1)
        if rank == 0:
            # Rank 0 usually hosts the store: stay until the failing rank has counted the
            # acknowledgements, or its own store calls fail (noisily) when this process exits.
            deadline = time.monotonic() + ACK_TIMEOUT_SECONDS
            while time.monotonic() < deadline and not store.check([_RELEASE_KEY]):
                time.sleep(0.05)
            if not _agent_hosts_store() and store.check([_EXPECTED_ACKS_KEY]):
                expected = int(store.get(_EXPECTED_ACKS_KEY))
                deadline = time.monotonic() + STORE_HOST_LINGER_SECONDS
                while time.monotonic() < deadline and store.add(_ACK_KEY, 0) < expected:
                    time.sleep(0.05)
    except Exception:  # noqa: BLE001
        pass


def _wait_for_failing_rank_to_exit(store: dist.Store) -> None:
    """Return once the rank that posted the failure record has exited (or after a bound)."""
    deadline = time.monotonic() + EXIT_ORDER_SECONDS
    try:
        while time.monotonic() < deadline and not store.check([_FAILING_RANK_KEY]):
            time.sleep(0.05)
        pid = local_pid(store, int(store.get(_FAILING_RANK_KEY)))
        if pid is None:  # on another host: wait until it has counted the acknowledgements
            while time.monotonic() < deadline and not store.check([_RELEASE_KEY]):
                time.sleep(0.05)
            time.sleep(EXIT_GAP_SECONDS)
            return
    except Exception:  # noqa: BLE001 - the store is gone: its host (maybe the failing rank) exited
        return
    while time.monotonic() < deadline and process_state(pid) not in (None, "Z", "X"):
        time.sleep(0.05)
    time.sleep(EXIT_GAP_SECONDS)


def _stopping_message(rank: int, step: int | None, record: str) -> str:
    if f"rank {rank} is frozen" in record:  # resumed after the others gave up on it
        return f"rank {rank} stopping at step {step}: this process was frozen and the other ranks stopped: {record}"
    return f"rank {rank} stopping at step {step}: {record}"


def _store_host() -> str:
    """Who hosts the rendezvous store: the torchrun agent when it shares its own, else rank 0."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if _agent_hosts_store():
        return f"the torchrun agent (the rendezvous store's host, {where})"
    return f"rank 0 (the rendezvous store's host, {where})"


def _agent_hosts_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _is_collective_error(exc: BaseException) -> bool:
    """Whether `exc`, or what it wraps, says a collective failed or timed out (so a peer, not this
    rank, is at fault)."""
    return any(_says_collective_failed(x) for x in _chain(exc))


def _says_collective_failed(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in _PLAIN_RUNTIME_ERROR_TEXT)


# ----------------------------------------------------------------------------------------------
# Watchdog (every rank)


def _ensure_watchdog(watch: _Watch) -> None:
    pg = dist.group.WORLD
    if watch.pg_id == id(pg):
        return  # watching this group already (or its store is gone: nothing to restart)
    watch.stop_thread()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"smp/reliability/{restart}/{next(_GENERATION)}/"
    watch.store = dist.PrefixStore(prefix, default_store())
    publish_process(watch.store, dist.get_rank())  # lets a census tell frozen from dead
    watch.pg_id = id(pg)
    watch.handling = False
    watch.store_host_pid = None
    watch.stop = threading.Event()
    watch.thread = threading.Thread(
        target=_watch, args=(watch, watch.store, dist.get_rank(), watch.stop), name="smp-watchdog", daemon=True
    )
    watch.thread.start()
    atexit.register(watch.stop_thread)  # never leave it inside a store call during interpreter teardown


def stop_watchdog() -> None:
    """Stop this session's watchdog (smp.shutdown stops it, with the session)."""
    watch = _WATCH.peek()
    if watch is not None:
        watch.stop_thread()


def _watch(watch: _Watch, store: dist.Store, rank: int, stop: threading.Event) -> None:
    answered_census = False
    while not stop.is_set():
        try:
            if _store_host_died(watch):
                return  # the collectives now fail fast too; the main thread reports it
            answered_census = answered_census or answer_census(store, rank, watch.step)
            if not watch.handling and store.check([FAILURE_KEY]):
                record = watch.record = store.get(FAILURE_KEY).decode()
                _acknowledge(store, rank)
                _wait_for_failing_rank_to_exit(store)
                _stop_process(_stopping_message(rank, watch.step, record), watch)
        except Exception:  # noqa: BLE001
            # The store is gone: a normal shutdown on rank 0, or the launcher exited. Either way
            # the collectives themselves now fail fast; nothing left to watch.
            return
        stop.wait(POLL_SECONDS)


def _stop_process(message: str, watch: _Watch | None = None) -> None:
    if watch is None or watch.claim_stop_line():
        _log(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    # The main thread may be blocked inside a collective that Python cannot interrupt.
    os._exit(PEER_FAILURE_EXIT_CODE)


# ----------------------------------------------------------------------------------------------
# Messages


def _describe(exc: BaseException) -> str:
    """One line: the exception's type and first line, and, when it wraps another (torch's pipeline
    raises "[Stage 1] failed to run forward:" from the stage's own error), the innermost cause's."""
    line = f"{type(exc).__name__}: {_first_line(exc)[:300]}"
    inner = _innermost(exc)
    if inner is not exc:
        line += f" (caused by {type(inner).__name__}: {_first_line(inner)[:300]})"
    return line


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0].strip()


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (or during), outermost first."""
    found = [exc]
    while True:
        x = found[-1]
        nxt = x.__cause__ if x.__cause__ is not None else (None if x.__suppress_context__ else x.__context__)
        if nxt is None or any(nxt is y for y in found):
            return found
        found.append(nxt)


def _innermost(exc: BaseException) -> BaseException:
    return _chain(exc)[-1]


def _note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def _log(message: str) -> None:
    # stderr directly as well as logging: the user may not have configured logging, and this
    # line is the one they need to find in a wall of tracebacks.
    print(f"[smp] {message}", file=sys.stderr, flush=True)
    logger.debug(message)
