"""Reading safetensors tensors by byte range, with no memory mapping.

A safetensors file is an 8-byte header length, a JSON header (per tensor: dtype, shape, and the
byte range of its row-major data) and the data. safetensors' own `safe_open` maps the whole file:
every page a read touches counts in the process's resident memory (what RSS-based killers
count, not only the page cache) until the file is closed, so a rank reading its half of each
tensor of a one-file model keeps most of the file resident. Here every read is a byte-range
read (`storage.RangeFile`: `os.preadv`) into memory the caller owns: the kernel's page cache
holds the file, the process holds only its tensors.

A box of a tensor (a rank's shard) is read in slabs of whole rows of at most `CHUNK_BYTES`:
a box that spans whole rows (FSDP's and row-wise TP's dim-0 shards) is one byte range, read
straight into the destination when dtype and layout allow. A box cut inside rows whose part of
each row is one byte range (a column split, Shard(1)) reads each row's part on its own, straight
into its place (a system call per row; measured cheaper in CPU than reading whole rows and
copying the columns out, or than one `preadv` per slab with the gaps read into a scratch buffer).
Any other box reads whole rows, one slab at a time, into a scratch buffer and
keeps its part. A slab is cast to the destination's dtype as it is copied, so a bf16 file into
an fp32 model never holds the bf16 tensor whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from smp.checkpointing import storage
from smp.checkpointing.storage import RangeFile
from smp.regular_files import NotReadable

# What one read holds beside its destination: a slab of whole rows (or one row, if larger).
# Larger slabs mean fewer system calls, more memory in flight.
CHUNK_BYTES = 16 << 20
# safetensors' own limit on the JSON header (a larger length is a damaged or hostile file).
HEADER_LIMIT = 100_000_000

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}


def load_host_bytes(whole_bytes: int, largest_bytes: int, rank_bytes: int) -> dict[str, int]:
    """Host memory a rank holds while a model is loaded, per path (docs/checkpoints.md):
    `weights`: `smp.transform(meta model, weights=folder)`: the rank's own shards, one tensor
    whole (a converter's sources, or a packed weight's boxes) and one read slab (resident and
    private alike: nothing is memory-mapped); `eager`: `from_pretrained` on every rank, then
    `smp.transform`: the whole model on every rank, before sharding frees the rest."""
    return {"weights": rank_bytes + largest_bytes + CHUNK_BYTES, "eager": whole_bytes}


class Damaged(Exception):
    """Why a file cannot be read as safetensors, as a phrase (the caller names the file)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of one file: where its bytes are and what they hold."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its data in the file


def read_header(path: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """({tensor name: Entry}, the header's `__metadata__`) of the safetensors file `path`, which
    must be a regular file (a link to one is followed: the Hub's cache folders are links). The
    header is checked as safetensors checks it: known dtypes, each tensor's byte range the size
    its shape and dtype give, the ranges tiling the data exactly to the end of the file (a
    truncated file fails here). Raises Damaged, or NotReadable for what is not a regular file."""
    with storage.current().open_ranges(path, follow_links=True) as file:
        size = file.size()
        head = file.read_at(8, 0)
        if len(head) < 8:
            raise Damaged(f"holds {size} bytes, fewer than a safetensors header length")
        length = int.from_bytes(head, "little")
        if length > HEADER_LIMIT or 8 + length > size:
            raise Damaged(f"declares a {length}-byte header in a {size}-byte file")
        raw = _pread_bytes(file, 8, length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise Damaged(f"has a header that is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise Damaged("has a header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise Damaged("has a __metadata__ that is not a map of strings")
    base = 8 + length
    entries, ranges = {}, []
    for name, info in header.items():
        entries[name] = _entry(path, name, info, base)
        ranges.append((info["data_offsets"][0], info["data_offsets"][1], name))
    end = 0
    for begin, stop, name in sorted(ranges):
        if begin != end:
            raise Damaged(f"places {name!r} at byte {begin} of its data, where {end} was expected "
                          "(the tensors' byte ranges overlap or leave a gap)")
        end = stop
    if base + end != size:
        raise Damaged(f"holds {size} bytes where its header describes {base + end}; it is truncated or damaged")
    return entries, metadata


def _entry(path: str, name: str, info: object, base: int) -> Entry:
    if not isinstance(info, dict):
        raise Damaged(f"describes {name!r} by a {type(info).__name__}, not an object")
    dtype = DTYPES.get(info.get("dtype"))
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise Damaged(f"gives {name!r} the dtype {str(info.get('dtype'))[:40]!r}, which smp does not read")
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise Damaged(f"gives {name!r} the shape {str(shape)[:100]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise Damaged(f"gives {name!r} the byte range {str(offsets)[:100]}")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise Damaged(f"gives {name!r} {offsets[1] - offsets[0]} bytes; its shape and dtype take "
                      f"{math.prod(shape) * dtype.itemsize}")
    return Entry(path, dtype, tuple(shape), base + offsets[0])


def read_box(entry: Entry, offsets: list[int], sizes: list[int], out: torch.Tensor) -> None:
    """Copy the box of `entry`'s tensor at `offsets` with `sizes` into `out` (of shape `sizes`,
    any dtype, device and strides: cast as copied). Reads only the rows the box crosses."""
    if 0 in sizes:
        return
    try:
        file = storage.current().open_ranges(entry.file, follow_links=True)
    except NotReadable as e:
        raise Damaged(str(e)) from None
    with file, torch.no_grad():
        _read(file, entry.start, entry.shape, entry.dtype, list(offsets), list(sizes), out.detach())


def _read(file: RangeFile, start: int, shape: tuple[int, ...], dtype: torch.dtype, offsets: list[int],
          sizes: list[int], out: torch.Tensor) -> None:
    if not shape:
        buf = torch.empty((), dtype=dtype)
        _pread_into(file, start, buf)
        out.copy_(buf)
        return
    row = math.prod(shape[1:]) * dtype.itemsize  # bytes of one index of dim 0
    if row > CHUNK_BYTES:  # one index of dim 0 is itself large: read it as a tensor of its own
        for i in range(sizes[0]):
            _read(file, start + (offsets[0] + i) * row, shape[1:], dtype, offsets[1:], sizes[1:], out[i])
        return
    whole_rows = list(offsets[1:]) == [0] * (len(shape) - 1) and list(sizes[1:]) == list(shape[1:])
    if not whole_rows and list(offsets[2:]) == [0] * (len(shape) - 2) and list(sizes[2:]) == list(shape[2:]):
        _read_row_parts(file, start, shape, dtype, offsets, sizes, out)
        return
    step = max(1, CHUNK_BYTES // max(row, 1))
    for i in range(0, sizes[0], step):
        n = min(step, sizes[0] - i)
        target = out.narrow(0, i, n)
        at = start + (offsets[0] + i) * row
        if whole_rows and target.is_contiguous() and target.dtype == dtype and target.device.type == "cpu":
            _pread_into(file, at, target)  # straight into the destination: no copy
            continue
        buf = torch.empty((n, *shape[1:]), dtype=dtype)
        _pread_into(file, at, buf)
        for dim in range(1, len(shape)):
            buf = buf.narrow(dim, offsets[dim], sizes[dim])
        target.copy_(buf)


def _read_row_parts(file: RangeFile, start: int, shape: tuple[int, ...], dtype: torch.dtype, offsets: list[int],
                    sizes: list[int], out: torch.Tensor) -> None:
    """A box whose part of each row (index of dim 0) is one byte range: `sizes[1]` indices of
    dim 1 from `offsets[1]`, whole in the dims after. Each row's part is read on its own,
    straight into its row of the destination, or, when `out` is not a contiguous CPU tensor of
    the file's dtype, into a slab of parts (at most `CHUNK_BYTES`) that is then cast as copied."""
    inner = math.prod(shape[2:]) * dtype.itemsize  # bytes of one index of dim 1
    row, part = shape[1] * inner, sizes[1] * inner
    direct = out.is_contiguous() and out.dtype == dtype and out.device.type == "cpu"
    step = sizes[0] if direct else max(1, CHUNK_BYTES // max(part, 1))
    for i in range(0, sizes[0], step):
        n = min(step, sizes[0] - i)
        target = out.narrow(0, i, n)
        buf = target if direct else torch.empty((n, *sizes[1:]), dtype=dtype)
        parts = memoryview(buf.reshape(-1).view(torch.uint8).numpy()).cast("B")
        at = start + (offsets[0] + i) * row + offsets[1] * inner
        for r in range(n):
            _pread_view(file, at + r * row, parts[r * part:(r + 1) * part])
        if not direct:
            target.copy_(buf)


def _pread_into(file: RangeFile, offset: int, t: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `t` with the file's bytes from `offset`."""
    _pread_view(file, offset, memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"))


def _pread_view(file: RangeFile, offset: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = file.read_into(view[done:], offset + done)
        if n <= 0:
            raise Damaged(f"ends at byte {offset + done}, inside a tensor; it is truncated")
        done += n


def _pread_bytes(file: RangeFile, offset: int, length: int) -> bytes:
    parts, done = [], 0
    while done < length:
        part = file.read_at(min(length - done, 1 << 24), offset + done)
        if not part:
            raise Damaged(f"ends at byte {offset + done}, inside its header; it is truncated")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


@dataclass
class Stored:
    """One checkpoint key of a folder: its whole shape and dtype, and the pieces of it that its
    files hold, each with its offsets in the whole tensor (one piece at 0 in a consolidated
    folder; DCP's unconsolidated HF saves hold pieces)."""

    shape: list[int]
    dtype: torch.dtype
    pieces: list[tuple[Entry, list[int]]]

    def read(self, offsets: list[int], sizes: list[int], out: torch.Tensor) -> None:
        """Fill `out` (shape `sizes`) with the box at `offsets` of the whole tensor."""
        for entry, at in self.pieces:
            low = [max(o, a) for o, a in zip(offsets, at)]
            high = [min(o + z, a + s) for o, z, a, s in zip(offsets, sizes, at, entry.shape)]
            if any(h <= lo for lo, h in zip(low, high)):
                continue
            part = out
            for dim, (lo, h, o) in enumerate(zip(low, high, offsets)):
                part = part.narrow(dim, lo - o, h - lo)
            read_box(entry, [lo - a for lo, a in zip(low, at)], [h - lo for lo, h in zip(low, high)], part)

    def whole(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor, cast to `dtype` slab by slab."""
        out = torch.empty(self.shape, dtype=dtype)
        self.read([0] * len(self.shape), list(self.shape), out)
        return out
