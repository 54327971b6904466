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
import shutil

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


def _tied_aliases(model: nn.Module, present: set[str]) -> frozenset[str]:
    """Names absent from the file whose parameter is shared with a name that is present (tied
    weights: HF writes `lm_head.weight` or `embed_tokens.weight`, not both). Decided from the
    module structure, so every rank reaches the same answer whatever its shard holds."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(_clean(name))
    return frozenset(
        n for names in names_of.values() if any(x in present for x in names) for n in names if n not in present
    )


def load_hf(hf_dir: str | os.PathLike, model: nn.Module) -> None:
    """Stream a local HF safetensors checkpoint into an already transformed model. Collective.

    Every rank reads only its own slices. Tensors are cast to the model's dtypes.
    """
    wait()
    hf_dir = os.path.abspath(os.fspath(hf_dir))
    _check_hf_dir(hf_dir)
    state = get_model_state_dict(model)
    saved = _hf_shapes(hf_dir)
    tied = _tied_aliases(model, set(saved))
    metadata.check_compatible(saved, metadata.tensor_shapes(state), f"Hugging Face checkpoint {hf_dir!r}", tied)
    to_read = {k: v for k, v in state.items() if k not in tied}
    dcp.load(to_read, storage_reader=HuggingFaceStorageReader(hf_dir), no_dist=not _dist())
    set_model_state_dict(model, state)
