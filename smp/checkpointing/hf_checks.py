"""Checks of a Hugging Face safetensors folder before `load_hf` reads it: a truncated file, a
header that does not parse, or a forged `DCP_SHARDING_INFO` (the offsets torch's HF reader
places each tensor at) is a CheckpointError naming the file, not a raw `SafetensorError` or
DCP `CheckpointException` from deep inside the reader.

`DCP_SHARDING_INFO` (in a file's `__metadata__`, written by DCP's HF writer for sharded saves)
maps a tensor name to `{"saved_offsets": [...]}`: where the file's chunk sits in the whole
tensor. It must be a JSON object naming tensors of that file, each with one non-negative
integer offset per dimension; a tensor held by one file only must sit at offset 0 everywhere.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from smp.checkpointing.save_errors import summary
from smp.errors import CheckpointError

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"


def check_safetensors_files(hf_dir: str) -> None:
    """Open every `*.safetensors` header of `hf_dir` (safetensors checks each file's length
    against its header: a truncated file fails here) and check its DCP_SHARDING_INFO."""
    from safetensors import safe_open

    held: dict[str, list[tuple[str, list[int]]]] = {}  # tensor -> (file, offsets) per file holding it
    for file in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        name = os.path.basename(file)
        try:
            with safe_open(file, framework="pt") as f:
                ndims = {key: len(f.get_slice(key).get_shape()) for key in f.keys()}
                info = (f.metadata() or {}).get(SHARDING_INFO_KEY)
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike
            raise CheckpointError(
                f"Hugging Face checkpoint {hf_dir!r}: {name} cannot be read ({type(e).__name__}: "
                f"{str(e)[:200]}); it is truncated or damaged: copy it again"
            ) from None
        for key in ndims:
            held.setdefault(key, [])
        if info is None:
            for key, ndim in ndims.items():
                held[key].append((name, [0] * ndim))
            continue
        for key, offsets in _sharding_info(info, ndims, hf_dir, name).items():
            held[key].append((name, offsets))
    for key, places in held.items():
        if len(places) == 1 and any(places[0][1]):
            raise CheckpointError(
                f"Hugging Face checkpoint {hf_dir!r}: {places[0][0]}'s {SHARDING_INFO_KEY} places {key!r}, "
                f"which no other file holds, at offsets {places[0][1]}, not at 0; the file's metadata is "
                f"damaged or forged"
            )


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


def load_error(e: BaseException, hf_dir: str) -> CheckpointError:
    """The CheckpointError for a failure inside torch's HF reader (DCP's CheckpointException
    carries each rank's error)."""
    return CheckpointError(f"loading Hugging Face checkpoint {hf_dir!r} failed (its files passed the "
                           f"header checks): {summary(e)[:500]}")
