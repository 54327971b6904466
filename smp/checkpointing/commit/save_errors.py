"""What a failed checkpoint write reports: a full disk (told apart from other failures by the
errors' errno, their text and the free space left) or the failure itself, always saying that
the previous checkpoint is intact."""

from __future__ import annotations

import errno
import os

from smp.checkpointing import storage
from smp.errors import CheckpointError


def causes(e: BaseException) -> list[BaseException]:
    """`e`, its chained causes, and the per-rank exceptions a DCP CheckpointException carries."""
    found, stack = [], [e]
    while stack:
        x = stack.pop()
        if x is None or any(x is y for y in found):
            continue
        found.append(x)
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return found


def summary(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        return "; ".join(f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in sorted(failures.items()))
    return f"{type(e).__name__}: {e}"


def is_disk_full(e: BaseException, directory: str, needed: int) -> bool:
    """ENOSPC / EDQUOT anywhere in the error (exceptions from other ranks arrive pickled, as
    text), torch.save's C++ writer's `[enforce fail at inline_container.cc] unexpected pos` (its
    only report of a full disk), or an OSError with less free space than the save needs."""
    for x in causes(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(x) or "Disk quota exceeded" in str(x):
            return True
        # torch.save's zip writer found fewer bytes on disk than it wrote: a short write, which
        # a full disk or quota causes (the free space may be back by the time we look: another
        # rank's partial files are removed as its own write fails).
        if "unexpected pos" in str(x) and "inline_container" in str(x):
            return True
    if not any(isinstance(x, OSError) for x in causes(e)):
        return False  # not a write failure (an unpicklable `extra`, a planner error)
    try:
        return storage.current().free_bytes(directory) < needed
    except OSError:
        return False


def save_error(e: BaseException, path: str, needed: int) -> CheckpointError:
    """The CheckpointError for a failed write of checkpoint `path` (`needed`: its bytes)."""
    directory = os.path.dirname(path)
    if is_disk_full(e, directory, needed):
        try:
            free = f"{storage.current().free_bytes(directory) / 2**20:.1f} MiB are free there"
        except OSError:
            free = "free space unknown"
        return CheckpointError(
            f"disk full: saving checkpoint {path!r} needs about {needed / 2**20:.1f} MiB (all "
            f"ranks' shards), {free}. Free space or save elsewhere; the partial files are removed "
            f"and the previous checkpoint is intact ({summary(e)})"
        )
    return CheckpointError(f"saving checkpoint {path!r} failed (not committed; the previous checkpoint "
                           f"is intact): {summary(e)}")


def disk_full_or(e: CheckpointError, path: str, needed: int) -> CheckpointError:
    """The disk-full error when a full disk made rank 0's step of saving `path` fail, else `e`."""
    return save_error(e, path, needed) if is_disk_full(e, os.path.dirname(path), needed) else e
