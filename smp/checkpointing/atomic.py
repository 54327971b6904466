"""Atomic commits: a checkpoint becomes visible only when every byte of it is on disk.

Protocol (rank 0 does the filesystem steps, after every rank has written its shards):
  1. all ranks write into `<root>/.<name>.partial/` (a leftover from a crashed save is removed);
  2. rank 0 writes `smp_meta.json`, then the commit marker `smp_commit.json`, fsyncs both;
  3. rank 0 renames the directory to `<root>/<name>` (atomic on POSIX filesystems).
`latest(root)` only ever considers directories whose names do not start with "." *and* that
hold the commit marker, so a save killed at any point leaves the previous checkpoint latest.
The marker also guards filesystems whose renames are not atomic and copies made by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import time

COMMIT_FILE = "smp_commit.json"
PARTIAL_SUFFIX = ".partial"


def partial_dir(path: str) -> str:
    """Where a save to `path` writes before it commits: hidden beside it, same filesystem."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{PARTIAL_SUFFIX}")


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMIT_FILE))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare(path: str, kind: str = "sharded") -> str:
    """(rank 0) Clear a stale partial directory of the same name and create a fresh one.

    Refuses a target that exists and is not a committed checkpoint of the same kind (or an
    empty folder): overwriting replaces the whole directory, and a user's own files, or a root
    holding many checkpoints, must never be deleted by a save."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        replaceable = (os.path.isdir(path) and not os.listdir(path)) or (
            is_committed(path) and _marker(path)[1] == kind
        )
        if not replaceable:
            raise FileExistsError(
                f"{path!r} exists and is not an smp {kind} checkpoint; saving there would delete "
                f"its contents. Save to a new folder (e.g. <root>/step_N) or remove it first"
            )
    tmp = partial_dir(path)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit(path: str, kind: str = "sharded") -> None:
    """(rank 0) Mark the partial directory complete, then rename it into place.

    `kind` ("sharded" or "hf") goes into the marker: latest() and keep_last only ever pick
    sharded checkpoints, never an export that happens to sit beside them."""
    path = os.path.abspath(path)
    tmp = partial_dir(path)
    with open(os.path.join(tmp, COMMIT_FILE), "w") as f:
        json.dump({"committed_at_ns": time.time_ns(), "kind": kind}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(path):
        # Overwriting a checkpoint: move the old one aside first (two renames, then delete).
        old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _marker(path: str) -> tuple[int, str]:
    """(commit time, kind) from the marker; an unreadable marker sorts first."""
    try:
        with open(os.path.join(path, COMMIT_FILE)) as f:
            data = json.load(f)
        return int(data["committed_at_ns"]), str(data.get("kind", "sharded"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return -1, "sharded"


def committed(root: str) -> list[str]:
    """Complete sharded checkpoints directly under `root`, oldest commit first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(full) or not is_committed(full):
            continue
        when, kind = _marker(full)
        if kind == "sharded":
            found.append((when, name, full))
    return [full for _, _, full in sorted(found)]


def latest(root: str | os.PathLike) -> str | None:
    """The most recently committed checkpoint under `root`, or None. Never a partial one."""
    found = committed(os.fspath(root))
    return found[-1] if found else None


def keep_last(root: str, n: int, protect: str) -> list[str]:
    """(rank 0) Delete all but the newest `n` committed checkpoints; never `protect`.

    Also removes partial directories that killed saves left behind: saves run one at a time
    (each waits for the previous async one), so at commit time no other partial is live.
    """
    found = committed(root)
    doomed = [p for p in found[: max(len(found) - n, 0)] if os.path.abspath(p) != os.path.abspath(protect)]
    for p in doomed:
        # Un-commit first: a crash mid-delete leaves a directory latest() already ignores.
        os.remove(os.path.join(p, COMMIT_FILE))
        shutil.rmtree(p)
    for name in os.listdir(root):
        if name.startswith(".") and name.endswith(PARTIAL_SUFFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            doomed.append(os.path.join(root, name))
    return doomed
