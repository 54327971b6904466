"""File digests taken from the very bytes DCP writes and reads: one pass over the data, not two.

Hashing a checkpoint after writing it (or before loading it) reads every byte a second time from
the page cache; with a rank per core that second pass is ~30% of a load. Here DCP's own file
streams hash what goes through them:

- save: DCP writes each file front to back (`stream.write` only; `_HashingWrite` falls back to
  hashing the finished file if anything ever seeks), so the digest of the written bytes is the
  file's digest. Large writes go out 1 MiB at a time, each slice hashed while it is still in
  the CPU cache;
- load: DCP reads a file's items in any order, each through `torch.load`, which reads the zip
  records of a slice out of order (end-of-central-directory first, the tensor's bytes last, in
  one `readinto` straight into the tensor). `_HashingRead` keeps a running hash up to
  `hashed_to`: a read that starts there is hashed in place (a tensor's bytes 1 MiB at a time,
  right after each slice lands in the tensor); a small read ahead of it is kept until the hash
  gets there; a large read ahead first hashes the gap from the kept pieces, reading only what no
  read covered (a byte-range read on a file opened a second time, which leaves DCP's file position and
  readahead alone); at the end the rest of the file is hashed the same way. The loader sorts
  each file's items by offset, so on a same-layout load every byte is read from disk once.

What is checked is exactly what was loaded. Any file the rank verifies but DCP did not open is
hashed separately by the caller (resharded loads), and after a failed DCP read the caller
verifies every file again from disk, so a damaged file is always named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any, Iterator, Mapping

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from smp.checkpointing import storage
from smp.checkpointing.trust import digest, safe_read

_KEEP_BELOW = 1 << 20  # reads ahead of the hash up to this size are kept in memory
_KEEP_AT_MOST = 64 << 20  # bytes kept per file at most (more are read again instead)
_CHUNK = 8 << 20
_SLICE = 1 << 20  # bytes written or read, then hashed, at a time


class _HashingWrite:
    """A write stream that hashes what it writes; `seek` (never used by DCP) voids the hash."""

    def __init__(self, raw: Any, algo: str):
        self._raw, self._hasher = raw, digest.Hasher(algo)
        self.written, self.sequential = 0, True

    def write(self, data: Any) -> int:
        # A slice at a time, each hashed right after it is written, while it is still in the
        # CPU cache (hashing a whole tensor after writing it reads it from memory twice).
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _SLICE):
            part = view[start:start + _SLICE]
            while part:
                n = self._raw.write(part)
                self._hasher.update(part[:n])
                self.written += n
                part = part[n:]
        return len(view)

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._raw.seek(*args)

    def entry(self) -> dict | None:
        return {"bytes": self.written, "digest": self._hasher.result()} if self.sequential else None

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._raw, name)


class _HashingRead:
    """A read stream that hashes the file front to back whatever order it is read in."""

    def __init__(self, raw: Any, algo: str, gaps: storage.RangeFile):
        # Bytes no read covered are read through a descriptor of their own: the kernel keeps
        # readahead state per open file, and preads elsewhere on DCP's descriptor would feed
        # it a random pattern in the middle of DCP's sequential reads.
        self._raw, self._hasher, self._gaps = raw, digest.Hasher(algo), gaps
        # DCP's file views seek and tell around every read: bound here, not found by __getattr__.
        self.seek, self.tell = raw.seek, raw.tell
        self.hashed_to = 0
        self._ahead: dict[int, bytes] = {}  # kept reads beyond hashed_to: offset -> bytes
        self._kept = 0

    # the reads DCP and torch.load make
    def readinto(self, buffer: Any) -> int:
        # A slice at a time, each hashed right after it is read, while it is still in the CPU
        # cache (a tensor's bytes come in one readinto of its whole size).
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            at = self._raw.tell()
            n = self._raw.readinto(view[done:done + _SLICE])
            if not n:
                break
            self._saw(at, view[done:done + n])
            done += n
        return done

    def read(self, size: int = -1) -> bytes:
        at = self._raw.tell()
        data = self._raw.read(size)
        if data:
            self._saw(at, memoryview(data))
        return data

    def __getattr__(self, name: str) -> Any:  # seek, tell, seekable, readable, fileno, ...
        return getattr(self._raw, name)

    def _saw(self, at: int, view: memoryview) -> None:
        end = at + len(view)
        if end <= self.hashed_to:
            return
        if at > self.hashed_to:
            if len(view) < _KEEP_BELOW:  # kept, or over the cap read again when the hash gets here
                if self._kept + len(view) <= _KEEP_AT_MOST:
                    self._ahead[at] = bytes(view)
                    self._kept += len(view)
                return
            self.hash_up_to(at)
        self._hasher.update(view[self.hashed_to - at:])
        self.hashed_to = end

    def hash_up_to(self, stop: int) -> None:
        """Hash [hashed_to, stop) from the kept reads, reading from the file what none holds.
        The loader calls it at the start of each item (in offset order): everything before has
        been read as much as it will be, and the kept reads stay few."""
        for offset in sorted(self._ahead):
            if offset >= stop or self.hashed_to >= stop:
                break
            if offset > self.hashed_to:
                self._read_and_hash(offset)  # bytes no read covered (zip padding, skipped records)
            data = self._ahead[offset]
            end = min(offset + len(data), stop)
            if end > self.hashed_to:
                self._hasher.update(memoryview(data)[self.hashed_to - offset:end - offset])
                self.hashed_to = end
        if self.hashed_to < stop:
            self._read_and_hash(stop)
        for offset in [o for o, b in self._ahead.items() if o + len(b) <= self.hashed_to]:
            self._kept -= len(self._ahead.pop(offset))

    def _read_and_hash(self, stop: int) -> None:
        while self.hashed_to < stop:
            data = self._gaps.read_at(min(stop - self.hashed_to, _CHUNK), self.hashed_to)
            if not data:
                return  # the file ends before `stop`: it is shorter than recorded
            self._hasher.update(data)
            self.hashed_to += len(data)

    def finish(self) -> tuple[int, str]:
        """Hash the rest of the file; its size as hashed and `<algo>:<hex>`."""
        self.hash_up_to(self._gaps.size())
        return self.hashed_to, self._hasher.result()


class HashingFileSystem(FileSystem):
    """DCP's local file system whose streams hash what passes through them.

    Written files: `written[relative path] = {"bytes", "digest"}`. Read files listed in `expected`
    (relative path -> the save's entry): `checked[relative path] = problem or None`."""

    def __init__(self, root: str | os.PathLike, algo: str, expected: Mapping[str, Mapping] | None = None):
        super().__init__()
        self._root, self._algo = os.fspath(root), algo
        self._expected = dict(expected or {})
        self._lock = threading.Lock()  # DCP may write files from several threads
        self.written: dict[str, dict] = {}
        self.checked: dict[str, str | None] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        rel = os.path.relpath(os.fspath(path), self._root)
        fs = storage.current()
        if "w" in mode:
            with fs.open_stream(path, mode) as raw:
                stream = _HashingWrite(raw, self._algo)
                yield stream
            entry = stream.entry()
            if entry is not None:
                with self._lock:
                    self.written[rel] = entry
        elif rel in self._expected:
            entry = self._expected[rel]
            algo = str(entry["digest"]).split(":", 1)[0]
            with fs.open_ranges(path, regular=False) as gaps:
                with fs.open_stream(path, mode) as raw:
                    stream = _HashingRead(raw, algo, gaps)
                    yield stream
                    size, found = stream.finish()
            with self._lock:
                self.checked[rel] = digest.mismatch(entry, size, found)
        else:
            with fs.open_stream(path, mode) as raw:  # what DCP's own FileSystem.create_stream opens
                yield raw


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter recording each file's digest as it writes it (`written_digests`)."""

    def __init__(self, path: str | os.PathLike, algo: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = HashingFileSystem(path, algo)

    @property
    def written_digests(self) -> dict[str, dict]:
        return self.fs.written


class VerifyingReader(safe_read.SafeReader):
    """`SafeReader` that checks the digests of the `expected` files from the bytes DCP reads
    (`checked`), reading each file's items in offset order."""

    def __init__(self, path: str | os.PathLike, expected: Mapping[str, Mapping]):
        super().__init__(path)
        self.fs = HashingFileSystem(path, "", expected)

    @property
    def checked(self) -> dict[str, str | None]:
        return self.fs.checked

    def _slice_file(self, file, sinfo):
        if isinstance(file, _HashingRead):
            file.hash_up_to(sinfo.offset)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        def offset(item) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=offset)), planner)
