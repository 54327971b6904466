"""Census of the ranks after a collective failed: which are gone, which hang outside a collective.

A collective that fails or times out says only that some peer did not take part. The rank that
saw it asks every other rank, through the rendezvous store, where its main thread is; each
live rank's watchdog (smp/reliability/guard.py) answers with its step and the innermost frame
of user code. A rank that never answers died without a Python error (killed, out of memory,
segfault) or is frozen (SIGSTOP, a debugger): on the same host the census tells which from the
process's state, which every watchdog publishes (`publish_process`) when it starts.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import torch.distributed as dist

# How long a census waits for answers: a few watchdog poll periods.
CENSUS_SECONDS = 3.0
# Store key of the request (its value: the asking rank); answers go to "census/<rank>".
CENSUS_KEY = "census"
NOT_IN_COLLECTIVE = "outside torch.distributed"
# A rank whose own collective failed too, answering while it reports that failure (or takes a
# census of its own): alive and not hung, so no census line names it.
REPORTING = "reporting a failed collective itself"
# Store key of a rank's "<hostname> <pid>", for telling a dead process from a frozen one.
PROCESS_KEY = "process"


def publish_process(store: dist.Store, rank: int) -> None:
    store.set(f"{PROCESS_KEY}/{rank}", f"{socket.gethostname()} {os.getpid()}")


def local_pid(store: dist.Store, rank: int) -> int | None:
    """The pid of `rank`'s process when it runs on this host (else None: not published, or
    another host, whose processes this one cannot see)."""
    key = f"{PROCESS_KEY}/{rank}"
    if not store.check([key]):
        return None
    host, _, pid = store.get(key).decode().partition(" ")
    return int(pid) if host == socket.gethostname() else None


def process_state(pid: int) -> str | None:
    """The one-letter state of a process of this host from /proc (R, S, D, T, t, Z, ...), or
    None when it is gone (or /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def take_census(store: dist.Store, rank: int, world: int, step: int) -> tuple[str, int]:
    """Ask every other rank where it is; return the findings (one line per rank that is gone or
    not in a collective) and how many ranks answered."""
    store.set(CENSUS_KEY, str(rank))
    others = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + CENSUS_SECONDS
    answers: dict[int, str] = {}
    while time.monotonic() < deadline and len(answers) < len(others):
        for r in others:
            key = f"{CENSUS_KEY}/{r}"
            if r not in answers and store.check([key]):
                answers[r] = store.get(key).decode()
        time.sleep(0.05)
    silent = [r for r in others if r not in answers]
    stuck = {r: a for r, a in answers.items() if NOT_IN_COLLECTIVE in a and REPORTING not in a}
    pids = {r: local_pid(store, r) for r in silent}
    frozen = {r: pid for r, pid in pids.items() if pid is not None and process_state(pid) in ("T", "t")}
    gone = [r for r in silent if r not in frozen]
    lines = []
    if gone:
        elsewhere = " (or, on another host, froze)" if any(pids[r] is None for r in gone) else ""
        lines.append(
            f"rank(s) {gone} did not answer: they died without a Python error (killed, out of "
            f"memory, segfault, os._exit){elsewhere} around step {step}; the launcher's log has their exit status"
        )
    for r, pid in sorted(frozen.items()):
        lines.append(f"rank {r} is frozen at step {step}: its process {pid} is stopped (SIGSTOP, "
                     f"Ctrl-Z or a debugger), not dead")
    for r, where in sorted(stuck.items()):
        lines.append(f"rank {r} is not in a collective (hung?): {where}")
    if not lines:
        lines.append(
            "every rank answered from inside torch.distributed: the ranks ran different "
            "collectives (a rank-dependent branch in the training step?)"
        )
    return "\n".join(lines), len(answers)


def answer_census(store: dist.Store, rank: int, step: int | None) -> bool:
    """If a census was asked for, answer it with where this process's main thread is; return
    whether it was (a watchdog answers once)."""
    if not store.check([CENSUS_KEY]):
        return False
    store.set(f"{CENSUS_KEY}/{rank}", where_is_main(step))
    return True


def where_is_main(step: int | None) -> str:
    """"step S, in torch.distributed | outside torch.distributed, at file:line in function": the
    main thread's state and its innermost frame outside torch."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return f"step {step}, main thread finished"
    in_collective = reporting = False
    innermost_user = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if frame.f_code.co_name == "_handle_failure" and filename.endswith(os.path.join("reliability", "guard.py")):
            reporting = True
        if f"torch{os.sep}distributed" in filename:
            in_collective = True
        elif innermost_user is None and f"{os.sep}torch{os.sep}" not in filename:
            innermost_user = f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    state = "in torch.distributed" if in_collective else NOT_IN_COLLECTIVE
    if reporting:
        state = f"{NOT_IN_COLLECTIVE}, {REPORTING}"
    return f"step {step}, {state}, at {innermost_user}"
