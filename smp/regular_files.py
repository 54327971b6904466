"""Reading a small file that someone else may have planted: only a regular file, only so much.

A checkpoint root is shared, and a config path comes from the user: either may name something
that is not a file. Read naively, `smp_meta.json` as a symbolic link to `/dev/zero` fills memory,
and a FIFO blocks `open()` itself until a writer appears (forever). So the kind of file is
checked before it is opened (`lstat`, or `stat` where links are allowed), opened without blocking
and without following a final link (`O_NONBLOCK | O_NOFOLLOW`), checked again on the open
descriptor (a file swapped in between), and read only up to a limit.
"""

from __future__ import annotations

import os
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


class NotReadable(Exception):
    """Why a file may not be read, as a phrase that follows its name ("is a FIFO ...")."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str, *, follow_links: bool = False) -> None:
    """Raise NotReadable unless `path` is a regular file (by its status; nothing is opened)."""
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except FileNotFoundError:
        raise NotReadable("does not exist") from None
    except OSError as e:
        raise NotReadable(f"cannot be read: {e.strerror or type(e).__name__}") from None
    if not stat.S_ISREG(st.st_mode):
        what = _kind(st.st_mode)
        if what == "a symbolic link":
            raise NotReadable("is a symbolic link; smp reads only regular files there and never follows links")
        raise NotReadable(f"is {what}, not a regular file")


def open_regular(path: str, *, follow_links: bool = False) -> int:
    """A descriptor of `path`, opened only if it is a regular file (a final symbolic link is
    refused unless `follow_links`). The caller closes it. Raises NotReadable."""
    check_regular(path, follow_links=follow_links)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:  # ELOOP: a link swapped in after the lstat
        raise NotReadable(f"cannot be read: {e.strerror or type(e).__name__}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotReadable(f"is {_kind(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of `path` if it is a regular file of at most `limit` bytes; at most `limit` + 1
    bytes are ever read (a file that grows while read is refused too). Raises NotReadable."""
    fd = open_regular(path, follow_links=follow_links)
    try:
        if os.fstat(fd).st_size > limit:
            raise NotReadable(f"is larger than {_size(limit)}")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise NotReadable(f"cannot be read: {e.strerror or type(e).__name__}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise NotReadable(f"is larger than {_size(limit)}")
    return b"".join(chunks)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else (
        f"{n >> 10} KiB" if n >= 1 << 10 and n % (1 << 10) == 0 else f"{n} bytes")
