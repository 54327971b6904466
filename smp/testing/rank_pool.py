"""A pool of gloo ranks kept alive across test cases.

Spawning N processes and joining a process group costs 1-4 s on a small CPU machine; a test
suite with dozens of multi-rank cases cannot pay that per case. A `RankPool` starts the ranks
once; `pool.run(fn, name=value, ...)` runs `fn(name=value, ...)` on every rank (fn must be
importable by module and name; its arguments are passed by name so a call site reads on its own)
and returns the per-rank results, or raises with every failing rank's traceback.

A call that does not finish within its timeout kills the pool (so no rank is left hanging) and
raises `RankTimeout`; the next `run` starts a fresh pool.

Workers are forked from multiprocessing's fork server, which imports `PRELOAD` once: a freshly
spawned interpreter spent ~4 s of CPU importing torch, smp and transformers per worker (a 4-rank
pool took ~19 s to start on 2 busy cores, ~3 s forked). The server is a fresh interpreter too
(nothing of the calling process, no thread: forking it is safe); a worker's stdout and stderr
are the server's, i.e. the caller's when the first pool started.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import tempfile
import traceback
import warnings
from typing import Any, Callable


class RankTimeout(TimeoutError):
    pass


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: MASTER_PORT for locally started ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server (a module that is not installed is skipped). Beyond the top
# packages: what nearly every case imports on first use (DTensor, FSDP2, the pipelining package,
# transformers' modeling base with its quantizer imports, Llama, PEFT, accelerate). A pool is
# restarted every ~100 cases (MAX_WORKER_THREADS) and each rank used to import these again: ~4 s
# of CPU per rank; measured: tests/tensor_parallel + test_step 106.6 s -> 96.5 s.
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "smp", "transformers",
    "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "peft", "accelerate",
)


def _worker(rank: int, world_size: int, port: int, conn: Any, sys_path: list[str], crash_log: str) -> None:
    sys.path[:] = sys_path
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank killed by a native crash (a segfault in a gloo thread) writes every thread's Python
    # stack to `crash_log`; the pool names the crashing thread's frames in its error. (Not to
    # stderr: tests that read a dying pool's output look for gloo's own message there.)
    crash_file = open(crash_log, "w")
    faulthandler.enable(file=crash_file, all_threads=True)
    # Ranks share 2 cores: one intra-op thread each avoids oversubscription stalls.
    torch.set_num_threads(1)
    # A short collective timeout: a case that fails on one rank frees the others quickly.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90)
    )
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module_name, fn_name, args, kwargs, filters = msg
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            with warnings.catch_warnings():
                _apply_filters(filters)
                result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", traceback.format_exc()))
            _reset_smp()
    dist.barrier()  # gloo may abort at exit without it (docs/platform.md)
    dist.destroy_process_group()


def _filter_specs() -> list[tuple]:
    """The caller's warning filters (pytest's `filterwarnings` included) as plain values, so that
    a case runs on the ranks under the filters it would run under in the calling process: a
    warning the suite turns into an error fails a multi-rank case too."""
    def text(pattern: Any) -> str:  # compiled, a plain string (some filters hold one), or None
        return "" if pattern is None else getattr(pattern, "pattern", pattern)

    return [(action, text(message), category.__module__, category.__qualname__, text(module), lineno)
            for action, message, category, module, lineno in warnings.filters]


def _apply_filters(specs: list[tuple]) -> None:
    warnings.resetwarnings()
    for action, message, cat_module, cat_name, module, lineno in reversed(specs):  # filters[0] wins
        try:
            category = getattr(importlib.import_module(cat_module), cat_name)
        except (ImportError, AttributeError):  # a category this process cannot import: skip it
            continue
        warnings.filterwarnings(action, message, category, module, lineno, append=False)


def _reset_smp() -> None:
    """After a failed case, leave smp uninitialised so the next case starts clean."""
    try:
        import smp

        smp.shutdown()
    except Exception:  # noqa: BLE001
        pass


# Every smp.session builds new DeviceMesh sub-groups, and gloo keeps native threads of groups
# that ran async work alive even after they are destroyed (docs/platform.md). Over hundreds of
# cases a worker collects thousands of threads and the whole machine slows down, so a pool
# whose workers pass this many threads is restarted before its next case.
MAX_WORKER_THREADS = 400


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # no /proc (not Linux) or the process is gone: never restart for this
        return 0


def _how_it_ended(proc: mp.Process, crash_log: str) -> str:
    """A dead rank's exit, for the error: a signal (SIGSEGV: a native crash; SIGKILL: often the
    kernel's OOM killer) or an exit status, and where its crashing thread was in Python."""
    proc.join(timeout=10)
    code = proc.exitcode
    if code is None:
        return "its pipe closed, the process still running"
    if code >= 0:
        return f"exit status {code}"
    try:
        how = f"killed by signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
        how = f"killed by signal {-code}"
    where = _crashing_frames(crash_log)
    return f"{how}; in {where}" if where else how


def _crashing_frames(crash_log: str, keep: int = 4) -> str:
    """The innermost frames of the thread that crashed, from faulthandler's dump ('' when there
    is none: no dump, or a thread that never ran Python, such as gloo's own)."""
    try:
        with open(crash_log) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return ""
    frames = []
    for line in lines[start + 1:]:
        found = re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)
        if not found:
            break
        frames.append(f"{found[3]} ({os.path.basename(found[1])}:{found[2]})")
    return " <- ".join(frames[:keep])


def _new_file(prefix: str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path


class RankPool:
    def __init__(self, world_size: int, start_timeout: float = 120.0):
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._crash_logs: list[str] = []

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first pool)
        port = free_port()
        self._crash_logs = [_new_file(f"smp-rank{rank}-", ".crash") for rank in range(self.world_size)]
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, self.world_size, port, child, list(sys.path), self._crash_logs[rank]),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(self.start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results, errors = [None] * self.world_size, []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self.close(force=True)
                raise RankTimeout(f"rank {rank} did not finish {what} within {timeout:.0f}s")
            try:
                status, value = conn.recv()
            except EOFError:
                how = _how_it_ended(self._procs[rank], self._crash_logs[rank])
                self.close(force=True)
                raise RankFailure(f"rank {rank} died during {what} ({how})") from None
            if status == "ok" or status == "ready":
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RankFailure(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        if self._procs and max(_thread_count(p.pid) for p in self._procs) > MAX_WORKER_THREADS:
            self.close()
        if not self._procs:
            self._start()
        msg = (fn.__module__, fn.__name__, args, kwargs, _filter_specs())
        for conn in self._conns:
            conn.send(msg)
        return self._collect(timeout, f"{fn.__module__}.{fn.__name__}")

    def close(self, force: bool = False) -> None:
        if not force:
            for conn in self._conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    force = True
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self._procs, self._conns = [], []
        for path in self._crash_logs:
            try:
                os.remove(path)
            except OSError:
                pass
        self._crash_logs = []
