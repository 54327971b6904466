"""Where checkpoint bytes live: the filesystem operations the checkpoint code needs, in one class.

`LocalStorage` is POSIX (a local disk, or a shared filesystem such as Lustre, NFS, FSx); its
methods are exactly what the commit protocol (commit/atomic.py), the trust checks (trust/), the
save/load recipe (sharded.py) and the Hugging Face folder code (hf/) do to files: make folders,
list, stat, read a small file or a regular file only, write a small file (durably: fsync),
rename, fsync a folder, remove a tree, ask for free space, open a file for byte-range reads or
as a stream for DCP. Every caller gets the storage in use from `current()`, which returns the one
default instance, `DEFAULT`; an object store would be another class with these methods (its
`rename` a copy plus a marker, its `fsync_dir` a no-op) put there.

What stays direct, and why:
  - path arithmetic (`os.path.join`, `abspath`, `dirname`, `basename`, `relpath`): strings only,
    no file is touched;
  - reads on a file this class opened (`RangeFile`: `os.pread`, `os.preadv` straight into a
    destination tensor, `os.fstat`, `os.close`): they act on its descriptor, behind its methods;
  - `/proc/<pid>/stat` in commit/atomic.py: the host's process table (is a partial folder's
    writer alive), not checkpoint storage;
  - what torch and transformers write themselves: DCP's writers create the folder and rename
    its `.metadata` through DCP's `FileSystem` (trust/inline_digest.py's subclass opens its
    streams here, `open_stream`; DCP's Hugging Face writer in hf/export.py uses torch's own),
    and `config.save_pretrained(folder)` writes `config.json`;
  - `smp.regular_files` keeps its lstat / O_NOFOLLOW / fstat checks (a FIFO or a link planted
    in a shared root is refused, never opened): the methods `check_regular`, `read_regular` and
    `open_regular` call it, unchanged.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from smp import regular_files


class RangeFile:
    """A file open for reads at given offsets (no file position shared with anyone)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_at(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill `view` (or its start) from `offset`, straight into the caller's memory; the count read."""
        return os.preadv(self.fd, [view], offset)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalStorage:
    """A POSIX filesystem. Paths are plain absolute or relative paths."""

    # --- what is there
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def lexists(self, path: str) -> bool:
        """There, even as a dangling symbolic link."""
        return os.path.lexists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def lstat(self, path: str) -> os.stat_result:
        """The entry's own status (a link is not followed)."""
        return os.lstat(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def list(self, path: str) -> list[str]:
        return os.listdir(path)

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        return os.walk(path)

    def real_path(self, path: str) -> str:
        """`path` with every symbolic link resolved."""
        return os.path.realpath(path)

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free

    # --- reading
    def read_bytes(self, path: str) -> bytes:
        """A file smp wrote itself moments ago (the export's index), whole."""
        with open(path, "rb") as f:
            return f.read()

    def check_regular(self, path: str, *, follow_links: bool = False) -> None:
        """Raise NotReadable unless `path` is a regular file (smp.regular_files)."""
        regular_files.check_regular(path, follow_links=follow_links)

    def read_regular(self, path: str, limit: int, *, follow_links: bool = False) -> bytes:
        """A small file someone else may have planted: a regular file of at most `limit` bytes."""
        return regular_files.read_regular(path, limit, follow_links=follow_links)

    def open_regular(self, path: str) -> BinaryIO:
        """A regular file (never a link or a FIFO in its place), opened for reading."""
        return os.fdopen(regular_files.open_regular(path), "rb")

    def open_read(self, path: str) -> io.RawIOBase:
        """Unbuffered reads front to back (hashing a file into a buffer of the caller's)."""
        return open(path, "rb", buffering=0)

    def open_ranges(self, path: str, *, regular: bool = True, follow_links: bool = False) -> RangeFile:
        """A file for byte-range reads. `regular`: refuse anything but a regular file (a link to
        one only with `follow_links`); else open whatever is there (a file this process is reading
        already, through another descriptor)."""
        if regular:
            return RangeFile(regular_files.open_regular(path, follow_links=follow_links))
        return RangeFile(os.open(path, os.O_RDONLY))

    def open_stream(self, path: str | os.PathLike, mode: str) -> Any:
        """DCP's file streams ("wb" to write a shard, "rb" to read one), as DCP's own file system opens them."""
        return Path(path).open(mode)

    # --- writing
    def make_dirs(self, path: str) -> None:
        """Create `path` and its missing parents; FileExistsError if it is there."""
        os.makedirs(path)

    def write_file(self, path: str, data: bytes, *, durable: bool = False) -> None:
        """Create or replace a small file with `data`; `durable`: on disk (fsync) before returning."""
        with open(path, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())

    def open_update(self, path: str) -> BinaryIO:
        """A file smp wrote, opened to overwrite bytes in place (read, seek, write)."""
        return open(path, "r+b")

    def torch_save(self, obj: Any, path: str) -> None:
        """torch.save by path: its own C++ writer, whose short-write report tells a full disk
        (commit/save_errors.py)."""
        torch.save(obj, path)

    def rename(self, src: str, dst: str) -> None:
        """Atomic on POSIX: `dst` appears whole or not at all (a folder `dst` must not exist)."""
        os.rename(src, dst)

    def replace(self, src: str, dst: str) -> None:
        """A file over a file: `dst` is replaced atomically."""
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def remove_tree(self, path: str, *, ignore_errors: bool = False) -> None:
        shutil.rmtree(path, ignore_errors=ignore_errors)

    def fsync_dir(self, path: str) -> None:
        """Make a folder's entries (a file created or renamed in it) durable; best effort, silent."""
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


DEFAULT = LocalStorage()


def current() -> LocalStorage:
    """The storage checkpoints go through: the default POSIX one."""
    return DEFAULT
