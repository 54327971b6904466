"""`torch.sagemaker.checkpoint.utils`: keep the newest N checkpoint folders.

    limit_num_subdirs(path, num_kept, sort_fn=SORT_BY_LAST_INT, regex=r"^.*\\d+steps$", log=rank == 0)

`path` is a checkpoint folder (or a folder inside one, e.g. a per-rank `tp2-0`): the checkpoint
folder is the nearest of `path` and its parents whose name matches `regex` (with no regex:
`path` itself), and its siblings that match `regex` are the checkpoints. The newest `num_kept`
by `sort_fn` stay; the others are deleted. Only the rank that passes `log=True` logs and
deletes (SMP v2 scripts pass `log=dist.get_rank() == 0`), so the folders go once.

For rotation that never deletes a checkpoint still being written, and that knows which
checkpoints are complete, use smp.checkpointing.save(..., keep_last=N) (docs/checkpoints.md).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Callable

from smp.sagemaker._guide import unsupported_module_getattr

_log = logging.getLogger("smp.sagemaker")

_LAST_INT = re.compile(r"(\d+)(?!.*\d)")


def SORT_BY_LAST_INT(name: str) -> int:  # noqa: N802 - SMP v2's name
    """Sort key: the last integer in a folder name (`llama_v3-120steps` -> 120); -1 without one."""
    match = _LAST_INT.search(os.path.basename(os.path.normpath(name)))
    return int(match.group(1)) if match else -1


def _checkpoint_folder(path: str, pattern: re.Pattern | None) -> str | None:
    if pattern is None:
        return path
    folder = path
    while True:
        if pattern.match(os.path.basename(folder)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def limit_num_subdirs(path: str | os.PathLike, num_kept: int, sort_fn: Callable[[str], int] = SORT_BY_LAST_INT,
                      regex: str | None = None, log: bool = True) -> list[str]:
    """Delete all but the newest `num_kept` checkpoint folders beside `path`'s (see above).
    Returns the deleted folders (on the rank that deletes; [] elsewhere)."""
    if not log:
        return []
    if num_kept < 1:
        raise ValueError(f"limit_num_subdirs: num_kept={num_kept}; keep at least 1 checkpoint")
    pattern = re.compile(regex) if regex is not None else None
    folder = _checkpoint_folder(os.path.abspath(os.fspath(path)), pattern)
    if folder is None:
        return []
    root = os.path.dirname(folder)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))
             and (pattern is None or pattern.match(n))]
    doomed = sorted(names, key=sort_fn)[:-num_kept] if len(names) > num_kept else []
    for name in doomed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        _log.info("smp.sagemaker: removed old checkpoint %s", os.path.join(root, name))
    return [os.path.join(root, n) for n in doomed]


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.checkpoint.utils", "checkpoints",
    "smp implements limit_num_subdirs and SORT_BY_LAST_INT here",
)
