"""Atomic commits: a checkpoint becomes visible only when every byte of it is on disk.

Protocol (rank 0 does the filesystem steps, after every rank has written its shards):
  1. all ranks write into `<root>/.<name>.partial/` (a leftover from a crashed save is removed);
     rank 0 first writes `smp_partial.json` there, naming the run that owns it and the process
     writing it (host, pid, start time);
  2. rank 0 writes `smp_meta.json` (with every file's size and digest), then the commit marker
     `smp_commit.json` (kind, run id, save sequence number), fsyncs both;
  3. rank 0 renames the directory to `<root>/<name>` (atomic on POSIX filesystems).
`latest(root)` only ever considers directories whose names do not start with "." *and* that
hold the commit marker *and* whose listed files are all there with their recorded sizes, so a
save killed at any point, or a half-deleted or half-copied folder, leaves the previous
checkpoint latest. The marker also guards filesystems whose renames are not atomic.

What smp may delete or replace in a root it shares with the user and with other runs: only
folders it can prove it wrote in this run, i.e. whose commit marker (or, for a partial,
`smp_partial.json`) carries this run's id; a save to a name another run committed, or is still
writing, is refused. Two live runs sharing one run id in one root are unsupported, but caught:
a partial folder of this run id that a live process on this host other than this one writes is
refused, not deleted, naming that process; and rank 0 commits only a partial folder whose marker
still names its own process (one that another process replaced is never committed).
`latest(root)` returns this run's checkpoints. Where a run's id comes from,
so that a restarted job still finds and cleans up its earlier attempts' checkpoints: run.py.
Symbolic links (`latest -> step_2`, `best -> ../other_run/step_100`) are never listed, followed,
or deleted. Order is the save sequence number in the marker (one more than any in the root at
commit time), never a clock: clocks differ between nodes and jump.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import time

from smp.checkpointing import storage
from smp.checkpointing.commit import run
from smp.checkpointing.format import metadata
from smp.checkpointing.trust import digest
from smp.errors import CheckpointError
from smp.regular_files import NotReadable

log = logging.getLogger(__name__)

COMMIT_FILE = "smp_commit.json"
PARTIAL_FILE = "smp_partial.json"
PARTIAL_SUFFIX = ".partial"

ANY_RUN = "any"  # latest(root, run=ANY_RUN): the newest checkpoint of whichever run wrote it
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def run_id() -> str:
    """This run's id (see run.py; made now if none is known: collective, call on every rank)."""
    return run.current()


def adopt_run(saved_run_id: str | None) -> None:
    """After a load: a process without a run id continues the loaded checkpoint's run."""
    run.take_over(saved_run_id)


def partial_dir(path: str) -> str:
    """Where a save to `path` writes before it commits: hidden beside it, same filesystem."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{PARTIAL_SUFFIX}")


# Commit and partial markers hold a few fields; anything larger was not written by smp.
_MAX_MARKER_BYTES = 64 << 10


def is_committed(path: str) -> bool:
    """The folder holds a commit marker that is a regular file (a link or a FIFO planted in its
    place is not one, and is never opened)."""
    try:
        return stat.S_ISREG(storage.current().lstat(os.path.join(path, COMMIT_FILE)).st_mode)
    except OSError:
        return False


def prepare(path: str, run_id: str, kind: str = "sharded") -> str:
    """(rank 0) Clear a stale partial directory of the same name and create a fresh one.

    Refuses a target that exists and is not a committed checkpoint of the same kind (or an
    empty folder): overwriting replaces the whole directory, and a user's own files, or a root
    holding many checkpoints, must never be deleted by a save."""
    path = os.path.abspath(path)
    fs = storage.current()
    if fs.is_link(path):
        raise FileExistsError(f"{path!r} is a symbolic link; save to a real folder (smp never writes through links)")
    if fs.exists(path):
        replaceable = _is_empty_dir(path) or (
            is_committed(path) and _marker(path).get("kind", "sharded") == kind
        )
        if not replaceable:
            raise FileExistsError(
                f"{path!r} exists and is not an smp {kind} checkpoint; saving there would delete "
                f"its contents. Save to a new folder (e.g. <root>/step_N) or remove it first"
            )
        owner = _marker(path).get("run_id") if is_committed(path) else None
        if owner is not None and owner != run_id:
            raise FileExistsError(
                f"{path!r} is a checkpoint of another run ({run.short(owner)}); this is run {run.short(run_id)}. A "
                f"save never replaces another run's checkpoint: save under another name or root. If this is run "
                f"{run.short(owner)} restarted, set {run.RUN_ID_ENV}={run.short(owner)} (torchrun keeps one id "
                f"across --max-restarts; a new launch is a new run)"
            )
    tmp = partial_dir(path)
    if fs.lexists(tmp):
        owner = None if fs.is_link(tmp) else _partial_owner(tmp)
        if owner is None and not (not fs.is_link(tmp) and _is_empty_dir(tmp)):
            raise FileExistsError(
                f"{tmp!r} exists and was not made by an smp save; smp writes a save to {path!r} "
                f"there first. Rename or remove it"
            )
        writer = _live_writer(tmp) if owner == run_id else None
        if writer is not None:
            raise FileExistsError(
                f"{tmp!r} is being written by another live process of this run ({writer}); this is process "
                f"{os.getpid()}. Two runs with one {run.RUN_ID_ENV} ({run.short(run_id)}) in one root delete and "
                f"overwrite each other's checkpoints: give each run its own {run.RUN_ID_ENV} or root, or stop "
                f"the other one"
            )
        if owner is not None and owner != run_id:
            raise FileExistsError(
                f"{tmp!r} is a save of {path!r} by another run ({run.short(owner)}), still being written or "
                f"left by a killed save; this is run {run.short(run_id)}, and a save never deletes another run's "
                f"files. Save under another name or root; if no run is writing it any more, delete it. If this "
                f"is run {run.short(owner)} restarted, set {run.RUN_ID_ENV}={run.short(owner)}"
            )
        fs.remove_tree(tmp)  # this run's crashed save's leftover (or an empty folder)
    fs.make_dirs(tmp)
    try:
        fs.write_file(os.path.join(tmp, PARTIAL_FILE), json.dumps({"run_id": run_id, **_this_process()}).encode())
    except BaseException:
        # A folder without its marker would block every later save to `path` (not provably smp's).
        fs.remove_tree(tmp, ignore_errors=True)
        raise
    return tmp


def _is_empty_dir(path: str) -> bool:
    fs = storage.current()
    return fs.is_dir(path) and not fs.list(path)


def _process_start(pid: int) -> int | None:
    """The start time of process `pid` of this host (clock ticks since boot), None when it is gone.
    Read from the host's process table, not checkpoint storage (storage.py)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid())}


def _writer(path: str) -> dict:
    """The process fields of a partial folder's marker ({} when unreadable)."""
    try:
        data = json.loads(storage.current().read_regular(os.path.join(path, PARTIAL_FILE), _MAX_MARKER_BYTES))
    except (NotReadable, ValueError, RecursionError):
        return {}
    return {k: data.get(k) for k in ("host", "pid", "started")} if isinstance(data, dict) else {}


def _live_writer(path: str) -> str | None:
    """"host H, pid P" when another process of this host that is still alive (the same start time:
    not a reused pid) wrote the partial folder's marker; None otherwise (this process, a dead one,
    another host, whose processes cannot be seen, or an older marker without the fields)."""
    w = _writer(path)
    if w.get("host") != socket.gethostname() or not isinstance(w.get("pid"), int) or w["pid"] == os.getpid():
        return None
    started = _process_start(w["pid"])
    return f"host {w['host']}, pid {w['pid']}" if started is not None and started == w.get("started") else None


def _partial_owner(path: str) -> str | None:
    """The run id in a partial folder's `smp_partial.json`; None when it is not smp's."""
    try:
        owner = json.loads(storage.current().read_regular(os.path.join(path, PARTIAL_FILE), _MAX_MARKER_BYTES))["run_id"]
    except (NotReadable, ValueError, KeyError, TypeError, RecursionError):
        return None
    return owner if isinstance(owner, str) else None


def commit(path: str, kind: str = "sharded", run_id: str | None = None) -> None:
    """(rank 0) Mark the partial directory complete, then rename it into place.

    `kind` ("sharded" or "hf") goes into the marker: latest() and keep_last only ever pick
    sharded checkpoints, never an export that happens to sit beside them. `run_id` is the
    run that may later delete it (keep_last); None: no run may."""
    path = os.path.abspath(path)
    tmp = partial_dir(path)
    writer = _writer(tmp)
    if writer and {k: writer[k] for k in ("host", "pid")} != {k: _this_process()[k] for k in ("host", "pid")}:
        raise FileExistsError(
            f"{tmp!r} was taken over while this process (pid {os.getpid()}) wrote it: its marker now names host "
            f"{writer.get('host')}, pid {writer.get('pid')}, another process saving {path!r} with the same run "
            f"id. Not committed (the folder may hold both processes' files). Give each run its own "
            f"{run.RUN_ID_ENV} or root"
        )
    marker = {"kind": kind, "run_id": run_id, "sequence": _next_sequence(os.path.dirname(path)),
              "committed_at_ns": time.time_ns()}  # the time is for people; order uses "sequence"
    fs = storage.current()
    fs.write_file(os.path.join(tmp, COMMIT_FILE), json.dumps(marker).encode(), durable=True)
    fs.fsync_dir(tmp)
    if fs.exists(path):
        # Overwriting a checkpoint: move the old one aside first (two renames, then delete).
        old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")
        if fs.exists(old):
            fs.remove_tree(old)
        fs.rename(path, old)
        fs.rename(tmp, path)
        fs.remove_tree(old)
    else:
        fs.rename(tmp, path)
    fs.fsync_dir(os.path.dirname(path))
    # The commit marker now names the run; the partial marker was only for the unfinished
    # folder, and an exported folder goes to users (the Hub) without smp's scratch files. A
    # crash before this line leaves it in a committed folder, where nothing reads it.
    try:
        fs.remove(os.path.join(path, PARTIAL_FILE))
    except FileNotFoundError:
        pass


def _marker(path: str) -> dict:
    """The commit marker's fields; {} when it is missing or unreadable."""
    try:
        data = json.loads(storage.current().read_regular(os.path.join(path, COMMIT_FILE), _MAX_MARKER_BYTES))
    except (NotReadable, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _order(name: str, marker: dict) -> tuple[int, int, str]:
    """Save sequence number, then the folder name's trailing number (`step_100`), then the name."""
    seq = marker.get("sequence")
    number = _TRAILING_NUMBER.search(name)
    return (seq if isinstance(seq, int) else -1, int(number.group(1)) if number else -1, name)


def _listed(root: str) -> list[tuple[tuple, str, dict]]:
    """(order, path, marker) of every committed folder directly under `root`: no hidden
    names, no symbolic links."""
    fs = storage.current()
    if not fs.is_dir(root):
        return []
    found = []
    for name in fs.list(root):
        full = os.path.join(root, name)
        if name.startswith(".") or fs.is_link(full) or not fs.is_dir(full):
            continue
        if not is_committed(full):
            if fs.lexists(os.path.join(full, COMMIT_FILE)):
                log.warning("smp.checkpointing: skipping %r: its %s is not a regular file (planted?)", full, COMMIT_FILE)
            continue
        marker = _marker(full)
        found.append((_order(name, marker), full, marker))
    return sorted(found)


def _next_sequence(root: str) -> int:
    return 1 + max((order[0] for order, _, _ in _listed(root)), default=0)


def committed(root: str) -> list[str]:
    """Committed sharded checkpoints directly under `root`, oldest save first."""
    return [full for _, full, marker in _listed(root) if marker.get("kind", "sharded") == "sharded"]


def incomplete(path: str) -> str | None:
    """Why a committed folder cannot be loaded, from its metadata and a stat per file (None
    when its metadata reads and every recorded file is there at its size)."""
    try:
        meta = metadata.read(path)
    except CheckpointError as e:
        return str(e)
    if meta.get("files") is None:  # format 1: load() refuses it without allow_unverified=True
        return ("saved before smp recorded file digests, so it cannot be verified; load it by path "
                "with allow_unverified=True if you trust it")
    found = digest.problems(path, meta["files"], sorted(meta["files"]), read=False)
    return "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "") if found else None


def complete(path: str) -> bool:
    """Committed, with readable metadata and every recorded file present at its size."""
    return incomplete(path) is None


def latest(root: str | os.PathLike, run: str | None = None) -> str | None:
    """The most recently saved complete checkpoint of this run under `root`, or None. Never a
    partial one, never one with a missing or truncated file or a planted metadata file (each
    skipped with a warning), never a symbolic link.

    `run`: None for this run's (see run.py; a process that knows no run id yet gets the newest
    checkpoint when `root` holds one run's only, and a CheckpointError naming the runs when it
    holds several); "any" for the newest of whichever run; a run id for that run's."""
    from smp.checkpointing.commit import run as runs  # the parameter shadows the module here

    found = [(full, marker.get("run_id")) for _, full, marker in _listed(os.fspath(root))
             if marker.get("kind", "sharded") == "sharded"]
    wanted = run
    if run is None:
        mine = runs.known()
        if mine is not None:
            wanted = mine.id
        else:
            owners = {owner for _, owner in found}
            if len(owners) > 1:
                raise CheckpointError(_several_runs(os.fspath(root), found))
            wanted = ANY_RUN
    others = []
    for path, owner in reversed(found):
        if wanted != ANY_RUN and owner != wanted:
            others.append((path, owner))
            continue
        why = incomplete(path)
        if why is None:
            if others:
                _warn_others(others, wanted, path)
            return path
        log.warning("smp.checkpointing.latest: skipping %r: %s", path, why)
    if others:
        _warn_others(others, wanted, None)
    return None


def _several_runs(root: str, found: list[tuple[str, str | None]]) -> str:
    newest: dict[str | None, str] = {}
    for path, owner in found:
        newest[owner] = os.path.basename(path)  # found is oldest first: the last one stays
    listed = ", ".join(f"{run.short(owner) if owner else '(no run id recorded)'} (newest {name})"
                       for owner, name in newest.items())
    return (f"latest({root!r}): the root holds checkpoints of {len(newest)} runs: {listed}; this process "
            f"has no run id yet, so which one it continues is not known. Set {run.RUN_ID_ENV}=<id> to continue "
            f"that run, or pass run='<id>' (or run='any' for the newest of all)")


def _warn_others(others: list[tuple[str, str | None]], wanted: str, chosen: str | None) -> None:
    newest_path, newest_owner = others[0]
    log.warning(
        "smp.checkpointing.latest: %s of run %s; checkpoints of other runs are ignored (newest: %r of run %s). "
        "Pass run=%r or run='any' to resume another run's, or set %s to continue it",
        f"returning {chosen!r}" if chosen else "no checkpoint", run.short(wanted), newest_path,
        run.short(newest_owner), run.short(newest_owner), run.RUN_ID_ENV)


def keep_last(root: str, n: int, protect: str, run_id: str) -> list[str]:
    """(rank 0) Delete all but the newest `n` committed checkpoints of run `run_id`; never
    `protect`, never another run's checkpoint, a link, or a folder smp did not write.

    Also removes partial directories that this run's killed saves left behind: saves run one at
    a time (each waits for the previous async one), so at commit time no other partial is live.
    """
    ours = [full for _, full, marker in _listed(root)
            if marker.get("kind", "sharded") == "sharded" and marker.get("run_id") == run_id]
    doomed = [p for p in ours[: max(len(ours) - n, 0)] if os.path.abspath(p) != os.path.abspath(protect)]
    fs = storage.current()
    for p in doomed:
        # Un-commit first: a crash mid-delete leaves a directory latest() already ignores.
        fs.remove(os.path.join(p, COMMIT_FILE))
        fs.remove_tree(p)
    for name in fs.list(root):
        full = os.path.join(root, name)
        if (name.startswith(".") and name.endswith(PARTIAL_SUFFIX) and not fs.is_link(full)
                and _partial_owner(full) == run_id and _live_writer(full) is None):
            fs.remove_tree(full, ignore_errors=True)
            doomed.append(full)
    return doomed
