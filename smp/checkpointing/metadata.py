"""What a checkpoint says about itself (`smp_meta.json`), and the checks that read it back.

Every checkpoint records who wrote it (smp and torch versions, world size, parallel degrees)
and what it holds (each model parameter's name and global shape, plus a fingerprint of
them). `load` compares that list with the model it is given *before* any collective runs, so
a wrong checkpoint fails on every rank with the same readable message instead of a hang or a
stack of DCP planner errors.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from smp._version import __version__
from smp.errors import CheckpointError
from smp.mesh import ParallelDims

META_FILE = "smp_meta.json"
FORMAT_VERSION = 1
_MAX_LISTED = 20  # longer key lists are cut, with a count of the rest


def tensor_shapes(state_dict: Mapping[str, Any]) -> dict[str, list[int]]:
    """Name -> global shape for every tensor entry (DTensor shapes are already global)."""
    return {k: list(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def fingerprint(shapes: Mapping[str, list[int]]) -> str:
    text = "\n".join(f"{name}:{tuple(shape)}" for name, shape in sorted(shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_run(dims: ParallelDims | None) -> dict[str, Any]:
    """World size, and the parallel degrees of smp's run (`dims`; None under plain
    torch.distributed, where only the world size is known)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    run: dict[str, Any] = {"world_size": world}
    if dims is not None:
        run.update(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp)
    return run


def build(
    shapes: Mapping[str, list[int]], has_optimizer: bool, kind: str, dims: ParallelDims | None
) -> dict[str, Any]:
    return {
        "format": "smp-checkpoint",
        "format_version": FORMAT_VERSION,
        "kind": kind,  # "sharded" (DCP) or "hf" (safetensors export)
        "smp_version": __version__,
        "torch_version": torch.__version__,
        **describe_run(dims),
        "has_optimizer": has_optimizer,
        "fingerprint": fingerprint(shapes),
        "params": dict(shapes),
    }


def write(directory: str, meta: Mapping[str, Any]) -> None:
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, META_FILE)) as f:
        return json.load(f)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def check_compatible(
    saved: Mapping[str, list[int]], model: Mapping[str, list[int]], source: str,
    allow_missing: frozenset[str] = frozenset(),
) -> None:
    """Raise CheckpointError naming missing / unexpected keys and shape mismatches."""
    missing = sorted(k for k in model if k not in saved and k not in allow_missing)
    unexpected = sorted(k for k in saved if k not in model)
    mismatched = sorted(
        f"{k}: checkpoint {tuple(saved[k])} vs model {tuple(model[k])}"
        for k in model if k in saved and list(saved[k]) != list(model[k])
    )
    if not (missing or unexpected or mismatched):
        return
    if not set(saved) & set(model):
        raise CheckpointError(
            f"{source} is a checkpoint of another model: none of its {len(saved)} tensors "
            f"(e.g. {_listed(sorted(saved)[:3])}) is a parameter of this model (e.g. "
            f"{_listed(sorted(model)[:3])}); load it into the model it was saved from"
        )
    lines = [f"{source} does not match this model:"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}, in the model but not the checkpoint): {_listed(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}, in the checkpoint but not the model): {_listed(unexpected)}")
    if mismatched:
        lines.append(f"  shape mismatches ({len(mismatched)}): {_listed(mismatched)}")
    lines.append("  build the model with the same architecture/config it was saved with")
    raise CheckpointError("\n".join(lines))
