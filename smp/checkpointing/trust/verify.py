"""Load verification: a checkpoint folder is untrusted input. Before anything is read, the
folder is checked to be a committed smp checkpoint, every listed file present at its recorded
size, the small files against their digests and DCP's `.metadata` through the allow-list;
the data files' digests are checked from the bytes DCP reads. Every check is collective: all
ranks agree before the next step."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from smp._version import __version__
from smp.checkpointing import storage
from smp.checkpointing.commit import atomic
from smp.checkpointing.format import metadata
from smp.checkpointing.trust import digest, inline_digest, safe_read
from smp.checkpointing.collective import agree, rank, world
from smp.errors import CheckpointError
from smp.regular_files import NotReadable

log = logging.getLogger(__name__)

DAMAGED = "checkpoint {path!r} is damaged or unsafe; nothing was loaded (latest(root) skips checkpoints with missing or truncated files)"


def check_directory(path: str) -> dict[str, Any]:
    """`path`'s smp_meta.json, once the folder is known to be a committed sharded checkpoint."""
    fs = storage.current()
    if not fs.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not fs.is_dir(path):
        raise CheckpointError(f"checkpoint {path!r} is a file, not a checkpoint directory")
    for name in (atomic.COMMIT_FILE, metadata.META_FILE):  # planted: a FIFO, a link to /dev/zero
        if fs.lexists(os.path.join(path, name)):
            try:
                fs.check_regular(os.path.join(path, name))
            except NotReadable as e:
                raise CheckpointError(f"{os.path.join(path, name)!r} {e}; the checkpoint is damaged or unsafe: "
                                      f"load another one (latest(root) skips such folders)") from None
    smp_files = (metadata.META_FILE, atomic.COMMIT_FILE, atomic.PARTIAL_FILE)
    if (fs.lexists(os.path.join(path, safe_read.DCP_METADATA_FILE)) and not os.path.basename(path).endswith(
            atomic.PARTIAL_SUFFIX) and not any(fs.lexists(os.path.join(path, f)) for f in smp_files)):
        raise CheckpointError(
            f"{path!r} was not written by smp: it is a plain torch.distributed.checkpoint folder (a "
            f".metadata, none of {', '.join(smp_files)}), so it has no record of what it holds and no "
            f"digests to verify. If you trust it, load it with torch.distributed.checkpoint.load("
            f"state_dict, checkpoint_id={path!r}) (which unpickles its .metadata without smp's "
            f"allow-list), then smp.checkpointing.save it to get a verified smp checkpoint"
        )
    if os.path.basename(path).endswith(atomic.PARTIAL_SUFFIX) or (
        fs.exists(os.path.join(path, ".metadata")) and not atomic.is_committed(path)
    ):
        raise CheckpointError(
            f"{path!r} is an incomplete checkpoint (its save never committed); "
            f"use smp.checkpointing.latest(root) to find the newest complete one"
        )
    if not atomic.is_committed(path) or not fs.exists(os.path.join(path, metadata.META_FILE)):
        raise CheckpointError(
            f"{path!r} is not an smp checkpoint (no {atomic.COMMIT_FILE} / {metadata.META_FILE}); "
            f"pass a directory written by smp.checkpointing.save (export_hf folders load with load_hf)"
        )
    meta = metadata.read(path)
    for name, saved, running in (
        ("torch", meta.get("torch_version"), torch.__version__),
        ("smp", meta.get("smp_version"), __version__),
    ):
        if saved != running and rank() == 0:
            log.warning("smp.checkpointing.load: %r was saved with %s %s, this is %s %s",
                        path, name, saved, name, running)
    if meta.get("kind") != "sharded":
        raise CheckpointError(f"{path!r} is an smp {meta.get('kind')!r} export; load it with smp.checkpointing.load_hf")
    return meta


def my_files(files: dict[str, Any]) -> list[str]:
    """The listed files this rank verifies: those its rank wrote (ranks split the reading)."""
    me, n = rank(), world()
    return [f for f in sorted(files) if digest.writer_rank(f) % n == me]


def unverifiable(path: str, meta: dict[str, Any]) -> str | None:
    """Why `path` cannot be verified (None when it can): saved before smp recorded file digests."""
    if meta.get("files") is not None:
        return None
    return (f"{path!r} was saved before smp recorded file digests (smp_meta.json format_version "
            f"{meta.get('format_version')!r}, no 'files'): its files cannot be verified, so flipped or "
            f"truncated bytes in it would load silently. If you trust it, load it with "
            f"smp.checkpointing.load(..., allow_unverified=True), then save it again to give it digests")


def verify_structure(path: str, meta: dict[str, Any], allow_unverified: bool = False) -> None:
    """Before anything is read: every listed file present, a regular file inside the folder, at
    its recorded size; the small files (DCP's `.metadata`, `extra`) also against their digests;
    on rank 0 `.metadata` through the allow-list, naming only listed files. The large data files'
    digests are checked from the bytes DCP reads (`data_problems`). Collective."""
    files = meta.get("files")
    if files is None:  # format 1: saved before smp recorded digests
        if not allow_unverified:  # every rank read the same smp_meta.json: all raise alike
            raise CheckpointError(unverifiable(path, meta))
        if rank() == 0:
            log.warning("smp.checkpointing.load: %r predates file digests; loading it unverified "
                        "(allow_unverified=True)", path)
        return
    mine = my_files(files)
    small = [f for f in mine if not f.endswith(".distcp")]
    found = digest.problems(path, files, mine, read=False) or digest.problems(path, files, small, read=True)
    if rank() == 0 and not found:
        if safe_read.DCP_METADATA_FILE not in files:
            found.append(f"{safe_read.DCP_METADATA_FILE} is not among the files the save recorded")
        else:
            try:
                md = safe_read.read_dcp_metadata(path)
            except safe_read.UnsafeCheckpoint as e:
                found.append(str(e))
            else:
                unlisted = sorted({i.relative_path for i in md.storage_data.values()} - set(files))
                if unlisted:
                    found.append(f"{safe_read.DCP_METADATA_FILE} names files the save did not record: {unlisted[:5]}")
    agree("\n  ".join(found) or None, DAMAGED.format(path=path))


def data_to_verify(meta: dict[str, Any]) -> dict[str, dict]:
    """This rank's share of the data files (those its rank wrote) with their recorded entries."""
    files = meta.get("files") or {}
    return {f: files[f] for f in my_files(files) if f.endswith(".distcp")}


def data_problems(path: str, mine: dict[str, dict], reader: inline_digest.VerifyingReader,
                  read_failed: bool) -> str | None:
    """This rank's problems with its share of the data files, `mine` (None when all match):
    checked from the bytes DCP read (`reader.checked`); a file DCP did not open (a resharded
    load reads other ranks' files) is hashed here. After a failed read every file is hashed
    again from disk, so that the damaged one is named whatever DCP stopped on."""
    found = [] if read_failed else [f"{f} {why}" for f, why in sorted(reader.checked.items()) if why]
    rest = sorted(mine) if read_failed else sorted(set(mine) - set(reader.checked))
    found += digest.problems(path, mine, rest, read=True)
    return "\n  ".join(found) or None
