"""What a checkpoint says about itself (`smp_meta.json`), and the checks that read it back.

Every checkpoint records who wrote it (smp and torch versions, world size, parallel degrees,
run id) and what it holds (each model parameter's name and global shape, plus a fingerprint of
them; the optimizer's class, state-shaping options and number of parameter groups; for
sharded checkpoints, every file's size and digest). `read` treats the file as untrusted: a
damaged or hand-edited one is a CheckpointError, never a KeyError deep inside load. `load` compares that list with the model it is given *before* any collective runs, so
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
from smp.checkpointing import storage
from smp.errors import CheckpointError
from smp.mesh import ParallelDims
from smp.regular_files import NotReadable

META_FILE = "smp_meta.json"
FORMAT_VERSION = 2  # 2: "files" (sizes and digests) and the optimizer's options
# The fields load relies on, with their types; a file without them is damaged, not a checkpoint.
_REQUIRED = {"format": str, "format_version": int, "kind": str, "world_size": int,
             "has_optimizer": bool, "params": dict}
# Optimizer options that choose an implementation, not the result or the state kept: a run
# may resume on other hardware with another choice.
_IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
# smp_meta.json lists every parameter (~80 bytes each) and file: a few MiB for the largest
# models; a bound that no real one reaches, so a planted huge file is refused, not parsed.
MAX_META_BYTES = 64 << 20
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
        if dims.pp > 1:
            run["pp"] = dims.pp
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
    storage.current().write_file(os.path.join(directory, META_FILE), json.dumps(meta, indent=1).encode(), durable=True)


def read(directory: str) -> dict[str, Any]:
    """`smp_meta.json`, checked field by field; CheckpointError names what is wrong."""
    file = os.path.join(directory, META_FILE)
    try:
        # A regular file only (a FIFO, or a link to /dev/zero, planted in a shared root would
        # hang or fill memory), of bounded size.
        raw = storage.current().read_regular(file, MAX_META_BYTES)
    except NotReadable as e:
        raise CheckpointError(f"{file!r} {e}; the checkpoint is damaged or unsafe: load another one "
                              f"(latest(root) skips such folders)") from None
    try:
        meta = json.loads(raw.decode())
    except (ValueError, RecursionError) as e:  # empty, not UTF-8, not JSON, nested too deep
        raise CheckpointError(f"{file!r} cannot be read ({type(e).__name__}: {str(e)[:200]}); the checkpoint "
                              f"is damaged: load another one (latest(root) skips damaged ones)") from None
    wrong = _schema_problems(meta)
    if wrong:
        raise CheckpointError(f"{file!r} is damaged ({'; '.join(wrong)}); load another checkpoint "
                              f"(latest(root) skips damaged ones)")
    return meta


def _schema_problems(meta: Any) -> list[str]:
    if not isinstance(meta, dict):
        return [f"it holds a JSON {type(meta).__name__}, not an object"]
    wrong = [f"{key!r} is missing" if key not in meta else f"{key!r} is not a {kind.__name__}"
             for key, kind in _REQUIRED.items()
             if not isinstance(meta.get(key), kind) or (kind is int and isinstance(meta.get(key), bool))]
    if isinstance(meta.get("format"), str) and meta["format"] != "smp-checkpoint":
        wrong.append(f"format is {meta['format']!r}")
    if isinstance(meta.get("params"), dict) and not all(
            isinstance(k, str) and isinstance(v, list) and all(type(d) is int for d in v)
            for k, v in meta["params"].items()):
        wrong.append("'params' is not a map of names to shapes")
    version = meta.get("format_version")
    if meta.get("kind") == "sharded" and (not isinstance(version, int) or version >= 2):
        files = meta.get("files")
        if not isinstance(files, dict) or not files:
            wrong.append("'files' (the file list with digests) is missing")
        elif not all(isinstance(e, dict) and type(e.get("bytes")) is int and isinstance(e.get("digest"), str)
                     for e in files.values()):
            wrong.append("'files' entries are not {bytes, digest}")
        if not isinstance(meta.get("optimizer_options"), (dict, type(None))):
            wrong.append("'optimizer_options' is not an object")
    return wrong


def describe_optimizer(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What `check_optimizer` compares on load: class, state-shaping options, group count.

    Options are the optimizer's boolean and string defaults (amsgrad, maximize, nesterov,
    decoupled_weight_decay, ...) except implementation switches. Numeric hyperparameters (lr,
    betas, eps, weight_decay) are not compared: load restores the saved values, as torch's
    Optimizer.load_state_dict does, and a run may change them after loading."""
    if optimizer is None:
        return {"optimizer_class": None, "optimizer_options": None, "optimizer_param_groups": None}
    options = {k: v for k, v in sorted(optimizer.defaults.items())
               if isinstance(v, (bool, str)) and k not in _IMPLEMENTATION_OPTIONS}
    return {"optimizer_class": type(optimizer).__name__, "optimizer_options": options,
            "optimizer_param_groups": len(optimizer.param_groups)}


def check_optimizer(meta: Mapping[str, Any], optimizer: torch.optim.Optimizer | None, source: str) -> None:
    """Raise CheckpointError when `optimizer` cannot take the saved optimizer state."""
    if optimizer is None:
        return
    if not meta.get("has_optimizer"):
        raise CheckpointError(
            f"{source} holds no optimizer state (saved without one); "
            f"call load(path, model) and start the optimizer fresh"
        )
    saved, running = meta.get("optimizer_class"), type(optimizer).__name__
    if saved and saved != running:
        raise CheckpointError(
            f"{source} holds {saved} optimizer state, but a {running} optimizer was passed; build "
            f"the optimizer the run was saved with, or call load(path, model) and start the new "
            f"optimizer fresh"
        )
    now = describe_optimizer(optimizer)
    saved_options = meta.get("optimizer_options") or {}
    differ = [f"{k}={saved_options[k]!r} in the checkpoint, {now['optimizer_options'][k]!r} here"
              for k in sorted(saved_options) if k in now["optimizer_options"]
              and saved_options[k] != now["optimizer_options"][k]]
    groups = meta.get("optimizer_param_groups")
    if isinstance(groups, int) and groups != now["optimizer_param_groups"]:
        differ.append(f"{groups} parameter groups in the checkpoint, {now['optimizer_param_groups']} here")
    if differ:
        raise CheckpointError(
            f"{source} was saved with an optimizer built differently: " + "; ".join(differ)
            + f". Build the {running} with the options it was saved with (or call load(path, "
            f"model) and start this optimizer fresh)"
        )


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
