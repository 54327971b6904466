"""Hugging Face interop: consolidated safetensors export, and streaming import.

Export: every rank writes its own shards through DCP's `HuggingFaceStorageWriter`; rank 0 then
consolidates them, file to file, into `model-0000k-of-0000n.safetensors` plus
`model.safetensors.index.json`, and writes the model's `config.json`, so `from_pretrained`
loads the folder with no smp installed. The folder appears atomically, as a checkpoint does.

Import: each rank asks DCP's `HuggingFaceStorageReader` for exactly the slices of each tensor
that its shards hold (safetensors reads slices from the memory-mapped file), so no rank ever
holds more than its own shards plus one slice in flight: the whole model is never
materialised on one rank.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from smp.checkpointing import atomic, metadata
from smp.checkpointing.sharded import _agree_on_tmp, _dist, _rank, on_rank0, wait
from smp.errors import CheckpointError
from smp.mesh import ParallelDims

# transformers' own default shard size for save_pretrained; smaller means more, smaller files.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _file_index(state: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> output file number (1-based), filling files in model order."""
    mapping, index, used = {}, 1, 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def _save_model_config(model: nn.Module, directory: str) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        try:
            generation.save_pretrained(directory)
        except Exception:  # noqa: BLE001 - optional; a model without one loads fine
            pass


def export_hf(
    out_dir: str | os.PathLike,
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dims: ParallelDims | None = None,
) -> str:
    """`smp.checkpointing.export_hf` (see there), with the degrees of smp's run that the
    export records passed in as `dims` (None under plain torch.distributed)."""
    wait()
    out_dir = os.path.abspath(os.fspath(out_dir))
    state = get_model_state_dict(model)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    meta = metadata.build(metadata.tensor_shapes(state), False, "hf", dims)
    tmp = _agree_on_tmp(out_dir, "hf")
    try:
        writer = HuggingFaceStorageWriter(
            tmp, fqn_to_index_mapping=_file_index(state, max_shard_bytes),
            save_distributed=True, enable_consolidation=True,
        )
        dcp.save(state, storage_writer=writer, no_dist=not _dist())

        def finish() -> None:
            shutil.rmtree(os.path.join(tmp, "sharded"), ignore_errors=True)  # per-rank pieces
            _save_model_config(model, tmp)
            metadata.write(tmp, meta)
            atomic.commit(out_dir, kind="hf")

        on_rank0(finish, f"committing export {out_dir!r}")
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _hf_shapes(hf_dir: str) -> dict[str, list[int]]:
    """Names and shapes from the safetensors headers only (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


def _check_hf_dir(hf_dir: str) -> None:
    if not os.path.isdir(hf_dir):
        raise CheckpointError(
            f"Hugging Face checkpoint {hf_dir!r} is not a directory (load_hf reads local folders only)"
        )
    if not glob.glob(os.path.join(hf_dir, "*.safetensors")):
        found = sorted(os.listdir(hf_dir))[:10]
        hint = (" it holds PyTorch .bin weights: convert them to safetensors first"
                if any(n.endswith(".bin") for n in found) else "")
        raise CheckpointError(
            f"{hf_dir!r} is not a Hugging Face safetensors checkpoint (no *.safetensors file; "
            f"found {found});{hint or ' pass the folder that save_pretrained / export_hf wrote'}"
        )


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter used under two or more names (tied weights), in model order.
    Decided from the module structure, so every rank reaches the same answer whatever its
    shard holds."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(_clean(name))
    return [names for names in names_of.values() if len(names) > 1]


def _from_pretrained_rules(model: nn.Module) -> tuple[str, re.Pattern | None, re.Pattern | None, set[str]]:
    """What `from_pretrained` forgives, for this model: its base-model prefix, the patterns of
    checkpoint keys it ignores when unexpected (the class's `_keys_to_ignore_on_load_unexpected`,
    plus the legacy `rotary_emb.inv_freq` / `position_ids` buffers it drops for models that now
    hold them as non-persistent buffers) and when missing (`_keys_to_ignore_on_load_missing`),
    and the names of the model's non-persistent buffers (never in a state dict, often in old files)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    buffers = [_clean(n) for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    non_persistent = {
        _clean(f"{module_name}.{name}" if module_name else name)
        for module_name, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }

    def compiled(patterns: set[str]) -> re.Pattern | None:
        return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None

    return prefix, compiled(unexpected), compiled(missing), non_persistent


def _model_key(key: str, model_keys: set[str], prefix: str) -> str | None:
    """The model's name for checkpoint key `key`: itself, or with the base-model prefix
    stripped (a `bert.`-prefixed file into a base BertModel) or added (the reverse), as
    from_pretrained does; None when nothing matches."""
    if key in model_keys:
        return key
    if prefix:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in model_keys:
            return key[len(prefix) + 1:]
        if f"{prefix}.{key}" in model_keys:
            return f"{prefix}.{key}"
    return None


def _plan_hf_load(
    saved: dict[str, list[int]], model: nn.Module, model_shapes: dict[str, list[int]], source: str
) -> tuple[dict[str, str], list[str]]:
    """(checkpoint key -> model key for each tensor to read, what was forgiven, for the log).

    Follows from_pretrained's rules (`_from_pretrained_rules`); a tied parameter is read once,
    from the first of its names the file holds. Raises CheckpointError for anything else that
    does not match: missing or unexpected keys, shape mismatches.
    """
    prefix, ignore_unexpected, ignore_missing, non_persistent = _from_pretrained_rules(model)
    model_keys = set(model_shapes)
    mapping: dict[str, str] = {}
    present: set[str] = set()
    ignored: list[str] = []
    unexpected: dict[str, list[int]] = {}
    for key in saved:
        target = _model_key(key, model_keys, prefix)
        if target is None:
            target = _model_key(key, non_persistent, prefix)
            if target is not None or (ignore_unexpected and ignore_unexpected.search(key)):
                ignored.append(key)
            else:
                unexpected[key] = saved[key]
        elif target in present:  # the same tensor under its prefixed and its plain name
            ignored.append(key)
        else:
            mapping[key] = target
            present.add(target)
    tied_alias: set[str] = set()
    for names in _tied_groups(model):
        in_file = [n for n in names if n in present]
        if not in_file:
            continue  # none of its names in the file: reported missing below
        # A tied parameter is one tensor: read it from the first name the file holds; the
        # other names (absent, or a second copy of the same values) load nothing.
        tied_alias.update(n for n in names if n != in_file[0])
        for duplicate in in_file[1:]:
            key = next(k for k, v in mapping.items() if v == duplicate)
            del mapping[key]
            ignored.append(key)
    absent = model_keys - present - tied_alias
    forgiven_missing = {k for k in absent if ignore_missing is not None and ignore_missing.search(k)}
    # A base-model checkpoint (every key found under the prefix) into a model with a task head:
    # from_pretrained keeps the head's fresh init, so its keys are not "missing" (the fine-tuning
    # start: bert-base into BertForSequenceClassification).
    if prefix and mapping and all(v == f"{prefix}.{k}" for k, v in mapping.items()):
        forgiven_missing |= {k for k in absent if not k.startswith(prefix + ".")}
    ignored.extend(sorted(f"{k} (missing, keeps its init)" for k in forgiven_missing))
    metadata.check_compatible(
        {**{mapping[k]: v for k, v in saved.items() if k in mapping}, **unexpected},
        model_shapes, source, frozenset(tied_alias | forgiven_missing),
    )
    return mapping, ignored


def load_hf(hf_dir: str | os.PathLike, model: nn.Module) -> None:
    """Stream a local HF safetensors checkpoint into an already transformed model. Collective.

    Every rank reads only its own slices. Tensors are cast to the model's dtypes. Loads what
    `from_pretrained` loads for the same model: legacy and ignorable keys are skipped (named in
    one warning on rank 0), base-model prefixes are added or stripped, a tied weight may be in
    the file once or twice; any other mismatch raises CheckpointError.
    """
    wait()
    hf_dir = os.path.abspath(os.fspath(hf_dir))
    _check_hf_dir(hf_dir)
    state = get_model_state_dict(model)
    source = f"Hugging Face checkpoint {hf_dir!r}"
    mapping, ignored = _plan_hf_load(_hf_shapes(hf_dir), model, metadata.tensor_shapes(state), source)
    if ignored and _rank() == 0:
        warnings.warn(
            f"smp: load_hf {hf_dir!r} ignored {len(ignored)} key(s) that from_pretrained also ignores "
            f"(legacy buffers, ignorable or duplicate tied keys): {', '.join(ignored)}",
            stacklevel=2,
        )
    # Keyed by the file's names, holding the model's tensors: DCP writes straight into them.
    to_read = {key: state[target] for key, target in mapping.items()}
    dcp.load(to_read, storage_reader=HuggingFaceStorageReader(hf_dir), no_dist=not _dist())
    set_model_state_dict(model, state)
