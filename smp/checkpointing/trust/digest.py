"""File digests: what a checkpoint's files were when they were committed, and the checks against it.

At commit time every file of a checkpoint gets an entry `{"bytes": n, "digest": "<algo>:<hex>"}`
in `smp_meta.json`; each rank hashes the files it wrote itself, from the bytes as DCP writes
them (inline_digest.py), so hashing runs on every rank at once. `load` verifies every listed
file before anything is copied into the model (the data files from the bytes DCP reads);
`latest()` only checks that each file is there with its recorded size (a stat, no read).

The digest detects damage (flipped bits, truncation, a half-copied folder), not forgery: whoever
can rewrite the files can rewrite the digests. Loading stays safe against a forged checkpoint
because nothing in it is unpickled outside an allow-list (see safe_read.py).

xxh3-64 (the `xxhash` package, ~8 GB/s) when installed, otherwise CRC-32 (zlib, ~0.8 GB/s, about
the speed of a local disk, so noticeably slower saves and loads). The algorithm is recorded with
each digest, so a checkpoint verifies wherever it is read.
"""

from __future__ import annotations

import os
import re
import stat
import zlib
from typing import Mapping

from smp.checkpointing import storage

try:
    import xxhash
except ImportError:  # optional: CRC-32 from the standard library instead
    xxhash = None

_CHUNK = 8 * 2**20
_RANK_OF_FILE = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")


def algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


class Hasher:
    """A running digest: `update(buffer)` any number of times, then `result()` = `<algo>:<hex>`."""

    def __init__(self, algo: str):
        self.algo = algo
        if algo == "xxh3_64":
            if xxhash is None:
                raise RuntimeError("this checkpoint's digests are xxh3-64: `pip install xxhash` to verify it")
            self._h = xxhash.xxh3_64()
            self.update = self._h.update
        elif algo == "crc32":
            self._crc = 0
            self.update = self._update_crc
        else:
            raise RuntimeError(f"unknown digest algorithm {algo!r}")

    def _update_crc(self, chunk) -> None:
        self._crc = zlib.crc32(chunk, self._crc)

    def result(self) -> str:
        return f"{self.algo}:{self._h.hexdigest() if self.algo == 'xxh3_64' else format(self._crc, '08x')}"


def file_digest(path: str, algo: str) -> str:
    """`<algo>:<hex>` of the file's bytes, read in chunks (constant memory)."""
    hasher = Hasher(algo)
    # readinto one reused buffer: no new bytes object per chunk (about 1.5-2x faster than
    # read() from the page cache). Not mmap: a file truncated while mapped kills the process.
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with storage.current().open_read(path) as f:
        while n := f.readinto(buffer):
            hasher.update(view[:n])
    return hasher.result()


def mismatch(entry: Mapping, size: int, found: str) -> str | None:
    """Why a file of `size` bytes with digest `found` is not the one the save recorded (None
    when it is)."""
    if size != entry["bytes"]:
        return f"has {size} bytes, {entry['bytes']} were written (truncated or replaced)"
    if found != entry["digest"]:
        return "does not match its recorded digest (its bytes changed since the save)"
    return None


def writer_rank(relpath: str) -> int:
    """The rank that wrote a file (DCP's `__<rank>_<i>.distcp`, smp's `rank_<r>.pt`); rank 0
    for the rest (DCP's `.metadata`). Each rank hashes the files it wrote."""
    m = _RANK_OF_FILE.search(relpath)
    return int(m.group(1) or m.group(2)) if m else 0


def data_files(directory: str, skip: frozenset[str]) -> list[str]:
    """Every regular file under `directory` as a relative path, except the names in `skip`."""
    found = []
    for parent, _, files in storage.current().walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(parent, name), directory)
            if rel not in skip:
                found.append(rel)
    return sorted(found)


def describe(directory: str, relpaths: list[str], algo: str) -> dict[str, dict]:
    """{relpath: {"bytes", "digest"}} of the given files."""
    out = {}
    for rel in relpaths:
        full = os.path.join(directory, rel)
        out[rel] = {"bytes": storage.current().size(full), "digest": file_digest(full, algo)}
    return out


def unsafe_path(directory: str, relpath: str) -> str | None:
    """Why `relpath` may not be read as part of `directory` (None when it may): it must name a
    regular file inside the folder, reached without following a symbolic link."""
    if os.path.isabs(relpath) or ".." in relpath.replace("\\", "/").split("/"):
        return "points outside the checkpoint folder"
    fs = storage.current()
    full = os.path.join(directory, relpath)
    real_dir = fs.real_path(directory)
    if fs.real_path(full) != os.path.join(real_dir, os.path.normpath(relpath)):
        return "is reached through a symbolic link"
    try:
        mode = fs.lstat(full).st_mode
    except FileNotFoundError:
        return "is missing"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    return None


def problems(directory: str, files: Mapping[str, Mapping], relpaths: list[str], read: bool) -> list[str]:
    """What is wrong with the listed files: missing, wrong size, a link, outside the folder, and
    (with `read`) contents that differ from the recorded digest. One line per file."""
    found = []
    for rel in relpaths:
        entry = files[rel]
        why = unsafe_path(directory, rel)
        if why is None:
            size = storage.current().size(os.path.join(directory, rel))
            why = mismatch(entry, size, entry["digest"])
            if why is None and read:
                algo = str(entry["digest"]).split(":", 1)[0]
                try:
                    why = mismatch(entry, size, file_digest(os.path.join(directory, rel), algo))
                except (OSError, RuntimeError) as e:
                    why = f"cannot be verified: {e}"
        if why:
            found.append(f"{rel} {why}")
    return found


def complete(directory: str, files: Mapping[str, Mapping]) -> bool:
    """Cheap: every listed file is there, a regular file, with its recorded size."""
    return not problems(directory, files, sorted(files), read=False)
