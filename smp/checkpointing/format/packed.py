"""Packed tensor-parallel tensors in checkpoints: written and read box by box.

A tensor-parallel weight that fuses several parts (GPT-2's `c_attn` q|k|v, Mixtral's experts'
`gate_up_proj` gate|up) is split per part: each rank holds a slice of every part, so its share
is not one box of the whole tensor (a strided shard). torch.distributed.checkpoint describes a
rank's share by one offset and one size per dim, which cannot say that: on torch 2.13 it reads
a wrong, overlapping box there (rank 1 of a gate|up split over 2 ranks reads rows 16:48 of 64,
not 16:32 and 48:64), and refuses to write one ("overlapping chunks"). For these few tensors
(and their optimizer state, which has the same placements) smp lists the boxes a rank's part is
made of (`boxes`: per dim, the runs of consecutive indices its placements give it) and

- `save` writes one DCP chunk per box (`PackedSavePlanner`; the boxes of all ranks tile the
  tensor, so the checkpoint is plain DCP that any layout, or `dcp.load` without smp, reads);
  which tensors are packed is agreed by all ranks first (`packed_keys`);
- `load` reads each box into its place in the local tensor (`PackedLoadPlanner`), from
  whatever chunks the checkpoint holds;
- `export_hf` writes each box as a chunk of its own (hf/export.py), which the consolidation
  places by its offsets, and `load_hf` reads each box into its place (`held_boxes`);
  `whole_for_save` gathers them whole for writers that take whole tensors only.

No tensor is held whole by `save` or `load`: the extra cost is a few more, smaller chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from smp import _compat
from smp.checkpointing.trust.safe_read import SafeLoadPlanner
from smp.errors import CheckpointError


def _held(t: DTensor, dim: int) -> torch.Tensor:
    """The indices along `dim` of the whole tensor that this rank's local tensor holds, in its
    local order: a probe of `size` integers split by the placements on that dim alone."""
    strided = _compat.strided_shard_type()
    probe = []
    for p in t.placements:
        if isinstance(p, strided) and p.dim % t.ndim == dim:  # not a Shard subclass on every torch
            probe.append(_compat.strided_shard(0, p.split_factor))
        elif isinstance(p, Shard) and p.dim % t.ndim == dim:
            probe.append(Shard(0))
        else:
            probe.append(Replicate())
    device = t.to_local().device
    return distribute_tensor(torch.arange(t.shape[dim], device=device), t.device_mesh, probe, src_data_rank=None).to_local().cpu()


def read_whole(t: torch.Tensor) -> bool:
    """Whether `t` holds, on this rank, a part that is not one box of the whole tensor (a
    packed weight), which DCP's one offset per dim cannot describe: checkpoints read and write
    it by `boxes` instead, load_hf reads it whole and places it by `place`. Decided per dim
    from the indices the placements give this rank (`_held`). Ordinary strided shards (FSDP
    over a TP shard) hold one box: False."""
    if not isinstance(t, DTensor) or t.device_mesh.get_coordinate() is None:
        return False  # not a DTensor, or one this rank holds nothing of (DCP skips it too)
    if not any(isinstance(p, _compat.strided_shard_type()) for p in t.placements):
        return False  # Shard / Replicate only: one box, which DCP computes
    for dim in range(t.ndim):
        held = _held(t, dim)
        if held.numel() and not torch.equal(held, torch.arange(int(held[0]), int(held[0]) + held.numel())):
            return True
    return False


def boxes(t: DTensor) -> list[tuple[list[int], list[int], list[int]]]:
    """The boxes of the whole tensor that make up this rank's part of `t`: (offsets in the whole
    tensor, sizes, offsets in the local tensor). A packed q|k|v split over 2 ranks: 3 boxes."""
    runs_per_dim = []
    for dim in range(t.ndim):
        runs: list[list[int]] = []  # [whole start, local start, length]
        for local, index in enumerate(_held(t, dim).tolist()):
            if runs and runs[-1][0] + runs[-1][2] == index:
                runs[-1][2] += 1
            else:
                runs.append([index, local, 1])
        if not runs:
            return []  # this rank holds nothing of it
        runs_per_dim.append(runs)
    return [([r[0] for r in box], [r[2] for r in box], [r[1] for r in box]) for box in itertools.product(*runs_per_dim)]


def held_boxes(t: torch.Tensor) -> list[tuple[list[int], list[int], list[int]]]:
    """(offsets in the whole tensor, sizes, offsets in the local tensor) of each box of `t` this
    rank holds: the whole of a plain tensor, one box for a DTensor of Shard / Replicate
    placements, `boxes` for any other (a packed or strided shard); none when this rank is
    outside the DTensor's mesh."""
    if not isinstance(t, DTensor):
        return [([0] * t.dim(), list(t.shape), [0] * t.dim())]
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return []
    box = _shard_box(t, coordinate)
    return [box] if box is not None else boxes(t)


def _shard_box(t: DTensor, coordinate: list[int]) -> tuple[list[int], list[int], list[int]] | None:
    """The one box a DTensor of plain Shard / Replicate placements holds, from DTensor's split
    rule (`torch.chunk`: ceil(size / n) per rank, the last ones shorter or empty), mesh dim by
    mesh dim; None for other placements (a strided shard: `boxes`), or when the result does
    not match the local shape (never guessed)."""
    offsets, sizes = [0] * t.ndim, list(t.shape)
    for mesh_dim, p in enumerate(t.placements):
        if p.is_replicate():
            continue
        if type(p) is not Shard:
            return None
        dim, n, c = p.dim % t.ndim, t.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = -(-sizes[dim] // n)
        start = min(c * chunk, sizes[dim])
        offsets[dim] += start
        sizes[dim] = min(chunk, sizes[dim] - start)
    if sizes != list(t.to_local().shape):
        return None
    return offsets, sizes, [0] * t.ndim


def place(value: torch.Tensor, into: torch.Tensor, name: str, source: str) -> None:
    """Copy this rank's part of the whole tensor `value` into `into`: all of it for a plain tensor;
    for a DTensor, the part its placements give this rank (`distribute_tensor` on the DTensor's
    own mesh and placements with `src_data_rank=None`: local slicing, no communication; the
    inverse of `full_tensor`, strided shards included, which a chunk offset cannot describe:
    a packed gate|up split keeps a slice of each half)."""
    local = into
    if isinstance(into, DTensor):
        if any(p.is_partial() for p in into.placements):
            raise CheckpointError(f"{source}: {name} is a partial-sum DTensor ({into.placements}); smp "
                                  "cannot place a whole tensor into it")
        value = distribute_tensor(value.to(into.device), into.device_mesh, into.placements, src_data_rank=None).to_local()
        local = into.to_local()
    if value.shape != local.shape:
        raise CheckpointError(f"{source}: {name}: the part to place has shape {tuple(value.shape)}, this "
                              f"rank holds {tuple(local.shape)}")
    local.copy_(value)


def _tensors(state: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """(path of keys/indices, tensor) for every tensor in a nested state dict, in its order."""
    if isinstance(state, torch.Tensor):
        return [(path, state)]
    if isinstance(state, dict):
        return [item for k, v in state.items() for item in _tensors(v, (*path, k))]
    if isinstance(state, (list, tuple)):
        return [item for i, v in enumerate(state) for item in _tensors(v, (*path, i))]
    return []


def _key(path: tuple) -> str:
    return ".".join(map(str, path))


def packed_keys(state: Any) -> set[str]:
    """The keys (dotted paths: `model.<name>`, `optim.state.<name>.exp_avg`) of the tensors in
    `state` that some rank holds as a packed part (`read_whole`). Collective over the default
    group when distributed (an object gather): every rank gets the same set, also ranks that
    hold the tensor as one box or (pipelined) not at all."""
    mine = sorted(_key(path) for path, t in _tensors(state) if read_whole(t))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return set(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {key for keys in every for key in keys}


def _replaced(state: Any, new: dict[str, torch.Tensor], path: tuple = ()) -> Any:
    """`state` with the tensors at the keys of `new` replaced (containers copied, not changed)."""
    if isinstance(state, torch.Tensor):
        return new.get(_key(path), state)
    if isinstance(state, dict):
        return {k: _replaced(v, new, (*path, k)) for k, v in state.items()}
    if isinstance(state, list):
        return [_replaced(v, new, (*path, i)) for i, v in enumerate(state)]
    if isinstance(state, tuple):
        return tuple(_replaced(v, new, (*path, i)) for i, v in enumerate(state))
    return state


def whole_for_save(state: Any, keys: set[str]) -> Any:
    """`state` with the DTensors at `keys` gathered whole (plain host tensors, which DCP writes once).
    Collective over each tensor's mesh; every rank gathers the same keys in the same order."""
    whole = {}
    for path, t in _tensors(state):
        if _key(path) in keys and isinstance(t, DTensor):
            whole[_key(path)] = _compat.full_tensor(t.detach()).cpu()  # one whole tensor on the device at a time
    return _replaced(state, whole, ())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _narrow(t: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, offset, size)
    return t


def save_boxes(state: Any, keys: set[str]) -> dict[str, list[tuple[list[int], list[int], list[int]]]]:
    """{DCP's flat key: `boxes`} of the DTensors at `keys` (`packed_keys`) this rank holds."""
    return {_key(path): boxes(t) for path, t in _tensors(state) if _key(path) in keys and isinstance(t, DTensor)}


class PackedSavePlanner(DefaultSavePlanner):
    """DCP's save planner, writing each packed tensor as the boxes each rank holds (one chunk
    per box; the boxes of all ranks tile the tensor) instead of DCP's one wrong box per rank.

    A box is not contiguous in the local tensor, so writing it takes a contiguous copy; DCP's
    writer (torch 2.13's `_write_files_from_queue`) keeps every tensor it wrote until its file is
    closed, so those copies add up to one box per packed tensor for the whole save. A sync save
    can afford that (it holds no copy of the state); an async save, which already holds a host
    copy, stages each box contiguously once instead (`stage`), and the writer takes it as is."""

    def __init__(self, packed: dict[str, list[tuple[list[int], list[int], list[int]]]]):
        super().__init__()
        self.packed = packed
        self.staged: dict[str, list[torch.Tensor]] = {}  # fqn -> a host copy of each box, in `packed` order

    def stage(self, state: Any) -> dict[str, DTensor]:
        """For an async save: copy each packed tensor's boxes into host memory, one contiguous
        tensor per box, kept here and written as they are. Returns {key: a stand-in} for
        async_save.host_copy to put in their place: a DTensor of the same mesh, placements,
        shape and dtype whose local tensor holds no bytes (one element, expanded), which is all
        planning reads of it (the checkpoint's metadata is the same as without staging)."""
        stand_ins = {}
        for path, t in _tensors(state):
            fqn = _key(path)
            if fqn not in self.packed or not isinstance(t, DTensor):
                continue
            local = t.to_local().detach()
            copies = []
            for _, sizes, at in self.packed[fqn]:
                copies.append(torch.empty(sizes, dtype=local.dtype, device="cpu").copy_(_narrow(local, at, sizes)))
            self.staged[fqn] = copies
            empty = torch.zeros((), dtype=local.dtype).expand(local.shape)
            stand_ins[fqn] = DTensor.from_local(empty, t.device_mesh, t.placements, run_check=False,
                                                shape=t.shape, stride=t.stride())
        return stand_ins

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self.packed]
        for fqn, parts in self.packed.items():
            t = self.state_dict[fqn]
            properties = TensorProperties.create_from_tensor(_local(t))
            for offsets, sizes, _ in parts:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=t.size())))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        if fqn not in self.packed:
            return super().resolve_data(write_item)
        offsets = list(write_item.index.offset)
        i = next(i for i, part in enumerate(self.packed[fqn]) if part[0] == offsets)
        if fqn in self.staged:
            return self.staged[fqn][i]
        _, sizes, local = self.packed[fqn][i]
        return _narrow(_local(self.state_dict[fqn]), local, sizes).contiguous()


class PackedLoadPlanner(SafeLoadPlanner):
    """smp's load planner, reading each packed tensor (`read_whole` on this rank) box by box
    into its place in the local tensor instead of DCP's one wrong box."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self.packed = {fqn for fqn, t in self.state_dict.items() if read_whole(t)}
        if not self.packed:
            return plan
        items = [item for item in plan.items if item.dest_index.fqn not in self.packed]
        for fqn in sorted(self.packed):
            for offsets, sizes, local in boxes(self.state_dict[fqn]):
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for item in create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk]):
                    items.append(dataclasses.replace(
                        item, dest_index=MetadataIndex(fqn),
                        dest_offsets=torch.Size(a + b for a, b in zip(local, item.dest_offsets))))
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in getattr(self, "packed", ()):
            return _local(self.state_dict[index.fqn])
        return super().lookup_tensor(index)
