"""Reading a checkpoint without running code from it: a checkpoint is untrusted input.

Three places in a DCP checkpoint are pickles, and torch reads each with the full unpickler,
which calls whatever a `__reduce__` names (`os.system`, ...):
  - `.metadata`: DCP's FileSystemReader uses `pickle.load`. `read_dcp_metadata` uses an
    unpickler that admits only the classes DCP metadata is made of (`DCP_METADATA_CLASSES`,
    found by recording what a real `.metadata` of model + AdamW state unpickles), and refuses
    storage entries naming a file outside the folder or behind a symbolic link;
  - the non-tensor entries (optimizer hyperparameters): DCP's DefaultLoadPlanner reads them with
    `torch.load(weights_only=False)`; `SafeLoadPlanner` uses `weights_only=True`;
  - smp's `smp_extra/rank_<r>.pt`: `read_extra` uses `torch.load(weights_only=True)`, which
    admits tensors, numbers, strings, None, lists, tuples, dicts (and classes the user added
    with `torch.serialization.add_safe_globals`); anything else needs `allow_pickle=True`.
Tensor data itself DCP already reads with `weights_only=True`.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from smp._compat import set_element
from smp.checkpointing import storage
from smp.checkpointing.trust.digest import unsafe_path
from smp.regular_files import NotReadable

DCP_METADATA_FILE = ".metadata"

DCP_METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name, nothing else
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: where it was saved
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class UnsafeCheckpoint(Exception):
    """A checkpoint file that tries to name something it may not (a class, a path)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"{DCP_METADATA_FILE} names {module}.{name}, which is not part of DCP metadata "
            f"(refused: unpickling it could run code)"
        )


def read_dcp_metadata(directory: str) -> Metadata:
    """The folder's DCP metadata, unpickled with the allow-list, its storage paths checked."""
    try:  # a regular file in the folder, never a link or a FIFO planted in its place
        file = storage.current().open_regular(os.path.join(directory, DCP_METADATA_FILE))
    except NotReadable as e:
        raise UnsafeCheckpoint(f"{DCP_METADATA_FILE} {e}") from None
    with file as f:
        try:
            md = _MetadataUnpickler(f).load()
        except UnsafeCheckpoint:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed pickle
            raise UnsafeCheckpoint(f"{DCP_METADATA_FILE} is not readable DCP metadata: {type(e).__name__}: {e}") from e
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise UnsafeCheckpoint(f"{DCP_METADATA_FILE} holds a {type(md).__name__}, not DCP metadata")
    for index, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        why = "is not a file name" if not isinstance(rel, str) else unsafe_path(directory, rel)
        if why:
            raise UnsafeCheckpoint(f"{DCP_METADATA_FILE}: the data of {getattr(index, 'fqn', index)!r} is in {rel!r}, which {why}")
    return md


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` through `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(os.fspath(self.path))
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor entries with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_extra(file: str, allow_pickle: bool) -> Any:
    """smp's per-rank `{"extra", "rng"}` file: weights_only unless the caller trusts it. Only a
    regular file (never a link or a FIFO planted in its place)."""
    try:
        opened = storage.current().open_regular(file)
    except NotReadable as e:
        raise UnsafeCheckpoint(f"{os.path.basename(file)} {e}") from None
    with opened as f:
        return torch.load(f, weights_only=not allow_pickle)
