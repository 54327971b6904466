"""The files of a Hugging Face safetensors folder that `load_hf` reads, chosen and checked as
`from_pretrained` chooses them, before any tensor is read.

Which files (transformers 5.x, `_get_resolved_checkpoint_files` / `get_checkpoint_shard_files`):
`model.safetensors` if the folder has one (an index beside it is not read); else the files
`model.safetensors.index.json`'s `weight_map` names, each once, in sorted order, every tensor of
each (a later file's copy of a key wins there); other `*.safetensors` files in the folder are
ignored. A folder with neither (a DCP save not consolidated), which from_pretrained refuses, is
read whole: every `*.safetensors` in it.

What is refused, naming the file: a file that is not a regular file (a FIFO would block every
rank in `open()`; a link to a regular file is followed, as the Hub's cache folders are links),
an index larger than `INDEX_LIMIT` or not a map of names to files, an index entry outside the
folder, a key the index places in a file that does not hold it, a key held by two files (where
from_pretrained silently takes the last), a truncated file or a header that does not parse
(read.read_header), and a forged `DCP_SHARDING_INFO`.

`DCP_SHARDING_INFO` (in a file's `__metadata__`, written by DCP's HF writer for sharded saves)
maps a tensor name to `{"saved_offsets": [...]}`: where the file's piece sits in the whole
tensor. It must be a JSON object naming tensors of that file, each with one non-negative
integer offset per dimension; the pieces of a tensor must tile it exactly.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from smp.checkpointing import storage
from smp.checkpointing.hf.read import Damaged, Entry, Stored, read_header
from smp.errors import CheckpointError
from smp.regular_files import NotReadable

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
INDEX_LIMIT = 64 << 20  # a real index is a few MB at most (one line per tensor)


def read_folder(hf_dir: str) -> dict[str, Stored]:
    """{checkpoint key: Stored} of the folder's weight files (`weight_files`), every header
    checked. Raises CheckpointError naming the file."""
    names, weight_map = weight_files(hf_dir)
    pieces: dict[str, list[tuple[Entry, list[int]]]] = {}
    for name in names:
        entries, metadata = _header(hf_dir, name)
        info = metadata.get(SHARDING_INFO_KEY)
        ndims = {key: len(e.shape) for key, e in entries.items()}
        offsets = (_sharding_info(info, ndims, hf_dir, name) if info is not None
                   else {key: [0] * n for key, n in ndims.items()})
        for key, entry in entries.items():
            if weight_map is not None and weight_map.get(key, name) != name:
                raise CheckpointError(
                    f"Hugging Face checkpoint {hf_dir!r}: {key!r} is held by {name} and by "
                    f"{weight_map[key]} (where {INDEX_FILE} places it); from_pretrained would load "
                    f"whichever of them it reads last. Remove the stray copy."
                )
            pieces.setdefault(key, []).append((entry, offsets[key]))
    for key, name in (weight_map or {}).items():
        if not any(e.file == os.path.join(hf_dir, name) for e, _ in pieces.get(key, ())):
            raise CheckpointError(
                f"Hugging Face checkpoint {hf_dir!r}: {INDEX_FILE} places {key!r} in {name}, which does "
                "not hold it; the index and the files disagree"
            )
    return {key: _stored(key, parts, hf_dir) for key, parts in pieces.items()}


def weight_files(hf_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """(the names of the files to read, relative to `hf_dir`; the index's weight_map or None)."""
    fs = storage.current()
    if not fs.is_dir(hf_dir):
        raise CheckpointError(
            f"Hugging Face checkpoint {hf_dir!r} is not a directory (load_hf reads local folders only)"
        )
    if fs.lexists(os.path.join(hf_dir, SINGLE_FILE)):
        return [SINGLE_FILE], None
    if fs.lexists(os.path.join(hf_dir, INDEX_FILE)):
        weight_map = _read_index(hf_dir)
        return sorted(set(weight_map.values())), weight_map
    names = sorted(n for n in fs.list(hf_dir) if n.endswith(".safetensors"))
    if not names:
        found = sorted(fs.list(hf_dir))[:10]
        hint = (" it holds PyTorch .bin weights: convert them to safetensors first"
                if any(n.endswith(".bin") for n in found) else "")
        raise CheckpointError(
            f"{hf_dir!r} is not a Hugging Face safetensors checkpoint (no *.safetensors file; "
            f"found {found});{hint or ' pass the folder that save_pretrained / export_hf wrote'}"
        )
    return names, None


def _read_index(hf_dir: str) -> dict[str, str]:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"Hugging Face checkpoint {hf_dir!r}: {INDEX_FILE} {why}")

    try:
        index = json.loads(storage.current().read_regular(os.path.join(hf_dir, INDEX_FILE), INDEX_LIMIT, follow_links=True))
    except NotReadable as e:
        raise bad(str(e)) from None
    except (ValueError, RecursionError):
        raise bad("is not JSON") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise bad("has no weight_map mapping tensor names to file names")
    for key, name in weight_map.items():
        path = os.path.normpath(os.path.join(hf_dir, name))
        if os.path.isabs(name) or "\0" in name or os.path.commonpath([hf_dir, path]) != hf_dir or path == hf_dir:
            raise bad(f"places {key!r} in {name!r}, which is not a file inside the folder")
    return weight_map


def _header(hf_dir: str, name: str) -> tuple[dict[str, Entry], dict[str, str]]:
    try:
        return read_header(os.path.join(hf_dir, name))
    except NotReadable as e:
        raise CheckpointError(f"Hugging Face checkpoint {hf_dir!r}: {name} {e}") from None
    except (Damaged, OSError) as e:
        raise CheckpointError(
            f"Hugging Face checkpoint {hf_dir!r}: {name} cannot be read ({str(e)[:200]}); it is "
            "truncated or damaged: copy it again"
        ) from None


def _stored(key: str, parts: list[tuple[Entry, list[int]]], hf_dir: str) -> Stored:
    """The whole tensor `parts` make up, checked: one dtype and rank, no two pieces overlapping
    (a duplicate key), the pieces covering it."""
    first = parts[0][0]
    for entry, _ in parts[1:]:
        if entry.dtype != first.dtype or len(entry.shape) != len(first.shape):
            raise CheckpointError(
                f"Hugging Face checkpoint {hf_dir!r}: {key!r} is {first.dtype} {list(first.shape)} in "
                f"{os.path.basename(first.file)} and {entry.dtype} {list(entry.shape)} in {os.path.basename(entry.file)}"
            )
    shape = [max(at[d] + e.shape[d] for e, at in parts) for d in range(len(first.shape))]
    for i, (a, at_a) in enumerate(parts):
        for b, at_b in parts[i + 1:]:
            if all(max(x, y) < min(x + s, y + t) for x, s, y, t in zip(at_a, a.shape, at_b, b.shape)):
                raise CheckpointError(
                    f"Hugging Face checkpoint {hf_dir!r}: {key!r} is held by both {os.path.basename(a.file)} "
                    f"and {os.path.basename(b.file)} (from_pretrained would silently load whichever it reads "
                    "last); remove the stray copy"
                )
    if sum(math.prod(e.shape) for e, _ in parts) != math.prod(shape):
        files = sorted({os.path.basename(e.file) for e, _ in parts})
        raise CheckpointError(
            f"Hugging Face checkpoint {hf_dir!r}: the pieces of {key!r} in {', '.join(files)} (placed by "
            f"{SHARDING_INFO_KEY} at {[at for _, at in parts]}) do not cover its shape {shape}; the file's "
            "metadata is damaged or forged, or a piece is missing"
        )
    return Stored(shape, first.dtype, parts)


def _sharding_info(info: Any, ndims: dict[str, int], hf_dir: str, name: str) -> dict[str, list[int]]:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"Hugging Face checkpoint {hf_dir!r}: {name}'s {SHARDING_INFO_KEY} {why}; the "
                               f"file's metadata is damaged or forged")

    try:
        parsed = json.loads(info)
    except (ValueError, RecursionError, TypeError):
        raise bad("is not JSON") from None
    if not isinstance(parsed, dict):
        raise bad(f"holds a JSON {type(parsed).__name__}, not an object")
    offsets: dict[str, list[int]] = {}
    for key, entry in parsed.items():
        if key not in ndims:
            raise bad(f"names {str(key)[:100]!r}, which the file does not hold")
        found = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not (isinstance(found, list) and len(found) == ndims[key]
                and all(type(o) is int and o >= 0 for o in found)):
            raise bad(f"gives {key!r} the offsets {str(found)[:100]}, not {ndims[key]} non-negative integers")
        offsets[key] = found
    for key, ndim in ndims.items():
        offsets.setdefault(key, [0] * ndim)
    return offsets
