"""Hugging Face export: a consolidated safetensors folder that `from_pretrained` loads with no
smp installed.

Every rank writes its own shards through DCP's `HuggingFaceStorageWriter`; rank 0 then
consolidates them, file to file, into `model-0000k-of-0000n.safetensors` plus
`model.safetensors.index.json`, and writes the model's `config.json`. Integer, bool and complex
tensors (BatchNorm's `num_batches_tracked`), which that consolidation cannot write, go into one
more file written by rank 0 (nonfloat.py). The folder appears atomically, as a checkpoint does
(commit/atomic.py); into a folder holding other files it goes through folder.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from smp.checkpointing import storage
from smp.checkpointing.collective import is_dist as _dist
from smp.checkpointing.collective import on_rank0
from smp.checkpointing.collective import rank as _rank
from smp.checkpointing.commit import atomic
from smp.checkpointing.format import metadata, packed
from smp.checkpointing.format.pipeline import gather_over_pipeline, stages_view, whole_model_shapes
from smp.checkpointing.hf import nonfloat
from smp.checkpointing.hf.ties import one_copy_of_tied
from smp.checkpointing.sharded import _agree_on_tmp, wait
from smp.errors import CheckpointError
from smp.fp8 import plain_weights
from smp.mesh import ParallelDims

# transformers' own default shard size for save_pretrained; smaller means more, smaller files.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


# The most bytes of the whole model each rank's intermediate export file covers: DCP's writer
# builds each file in memory (twice: safetensors' `save` copies every tensor, then the file),
# so this bounds what an export holds beside the model. Smaller means more files to consolidate.
PIECE_BYTES = 64 << 20


class _PieceWriter(HuggingFaceStorageWriter):
    """DCP's HF writer (every rank writes its shards, rank 0 consolidates them into the files of
    `fqn_to_index_mapping`), with each rank's shards written as files of `piece_mapping` (at most
    PIECE_BYTES of the whole model each, one tensor alone if larger) instead of one file per
    output file: its in-memory build of each file is bounded, not the rank's whole share.

    A packed tensor-parallel weight (`packed`: its fqns) comes as one write item per box of the
    rank's part (packed.PackedSavePlanner). A file holds one chunk per tensor (its safetensors
    key is the tensor's name, its offsets in the file's metadata), so each box goes into a file
    of its own, numbered after the pieces; consolidation places every chunk by its offsets."""

    def __init__(self, path: str, fqn_to_index_mapping: dict[str, int], piece_mapping: dict[str, int],
                 packed: frozenset[str] = frozenset()) -> None:
        super().__init__(path, fqn_to_index_mapping=fqn_to_index_mapping, save_distributed=True,
                         enable_consolidation=True)
        self.piece_mapping = piece_mapping
        self.packed = packed

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [dataclasses.replace(plan, storage_data={**plan.storage_data, "fqn_to_index_mapping": self.piece_mapping})
                for plan in super().prepare_global_plan(plans)]

    def _split_by_storage_plan(self, storage_plan: dict[str, int] | None, items: list[Any]) -> dict[int, list[Any]]:
        buckets = super()._split_by_storage_plan(storage_plan, [i for i in items if i.index.fqn not in self.packed])
        following = max(self.piece_mapping.values(), default=0)
        for item in items:
            if item.index.fqn in self.packed:
                following += 1
                buckets[following] = [item]
        return buckets


def _file_index(sizes: list[tuple[str, int]], max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> output file number (1-based), filling files in model order from each
    tensor's (name, bytes)."""
    mapping, index, used = {}, 1, 0
    for name, size in sizes:
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
    # A pipelined model: this rank's stages under the whole model's names; the pipeline's
    # ranks write one folder together (each its stages' tensors, rank 0 consolidates).
    model, _, pp_group = stages_view(model)
    state = plain_weights(one_copy_of_tied(get_model_state_dict(model), model))  # fp8.all_gather's: plain tensors
    shapes = whole_model_shapes(metadata.tensor_shapes(state), pp_group, f"export_hf {out_dir!r}")
    # Integer, bool and complex tensors bypass torch's consolidation: checked whole and equal
    # on every rank here (or refused by name), written by rank 0 as one more file.
    nonfloats = nonfloat.check({k: v for k, v in state.items() if not nonfloat.consolidatable(v)},
                               pp_group, out_dir)
    state = {k: v for k, v in state.items() if nonfloat.consolidatable(v)}
    # Packed tensor-parallel weights (fused q|k|v, gate|up): DCP's one box per rank cannot
    # express a rank's part of them, so each box is written as a chunk of its own (packed.py,
    # _PieceWriter), never gathered whole. Collective: every rank learns which ones are packed.
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    packed_keys = packed.packed_keys(state)
    sizes = [(k, v.numel() * v.element_size()) for k, v in state.items()]
    scalars = {k: v.detach().cpu() for k, v in state.items() if v.dim() == 0}  # whole on every rank holding them
    if pp_group is not None:  # every rank needs the whole model's file layout; rank 0 its scalars
        parts = gather_over_pipeline((sizes, scalars), pp_group)
        sizes = [entry for part, _ in parts for entry in part]
        scalars = {k: v for _, part in parts for k, v in part.items()}
    meta = metadata.build(shapes, False, "hf", dims)
    tmp = _agree_on_tmp(out_dir, "hf")
    try:
        writer = _PieceWriter(tmp, _file_index(sizes, max_shard_bytes), _file_index(sizes, PIECE_BYTES),
                              frozenset(packed_keys))
        planner = packed.PackedSavePlanner(packed.save_boxes(state, packed_keys))
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=not _dist())

        def finish() -> None:
            storage.current().remove_tree(os.path.join(tmp, "sharded"), ignore_errors=True)  # per-rank pieces
            _write_scalars(tmp, scalars)
            nonfloat.write(tmp, nonfloats)  # renames the files: after _write_scalars read the index
            _save_model_config(model, tmp)
            metadata.write(tmp, meta)
            atomic.commit(out_dir, kind="hf")

        on_rank0(finish, f"committing export {out_dir!r}")
    except BaseException:
        if _rank() == 0:
            storage.current().remove_tree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_scalars(directory: str, scalars: dict[str, torch.Tensor]) -> None:
    """Write the values of 0-d tensors (CLIP's `logit_scale`) into the consolidated files, in
    place: torch's consolidation (checked on 2.13) reserves their bytes but writes zeros there.
    Each one's bytes are located from its file's safetensors header (8-byte length, JSON)."""
    if not scalars:
        return
    index_path = os.path.join(directory, "model.safetensors.index.json")
    fs = storage.current()
    if fs.exists(index_path):
        file_of = json.loads(fs.read_bytes(index_path))["weight_map"]
    else:
        file_of = dict.fromkeys(scalars, "model.safetensors")
    for name, value in scalars.items():
        data = value.detach().cpu().reshape(1).contiguous().view(torch.uint8).numpy().tobytes()
        with fs.open_update(os.path.join(directory, file_of[name])) as f:
            header_len = int.from_bytes(f.read(8), "little")
            start, end = json.loads(f.read(header_len))[name]["data_offsets"]
            if end - start != len(data):
                raise CheckpointError(f"export_hf: {name} takes {end - start} bytes in the file, its value {len(data)}")
            f.seek(8 + header_len + start)
            f.write(data)
