"""Packed tensor-parallel tensors in checkpoints: read and written whole, placed by their
own placements.

A tensor-parallel weight that fuses several parts (GPT-2's `c_attn` q|k|v, Mixtral's experts'
`gate_up_proj` gate|up) is split per part: each rank holds a slice of every part, so its share
is not one box of the whole tensor (a strided shard). torch.distributed.checkpoint describes a
rank's share by one offset and one size per dim, which cannot say that: on torch 2.13 it reads
a wrong, overlapping box there (rank 1 of a gate|up split over 2 ranks reads rows 16:48 of 64,
not 16:32 and 48:64), and refuses to write one ("overlapping chunks"). For these few tensors
(and their optimizer state, which has the same placements) smp instead

- writes the whole tensor (`full_tensor`, a gather over the tensor's mesh; DCP keeps one
  rank's copy of such a replicated tensor), which any other layout reads back by DCP's slicing;
- reads the whole tensor on each rank and keeps this rank's part by the placements
  (`place`: `distribute_tensor` with `src_data_rank=None`, local slicing, no communication).

Cost: while it saves or loads, every rank holds all such tensors whole in host memory (and one
at a time on its device); the file holds one copy of each. Which tensors are
packed is agreed by all ranks (`packed_keys`) before any collective, so every rank gathers the
same tensors in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from smp import _compat
from smp.errors import CheckpointError


def read_whole(t: torch.Tensor) -> bool:
    """Whether `t` must be read (and written) whole and placed by `place` rather than sliced by
    DCP: a DTensor whose part on this rank is not one box of the whole tensor. Decided per dim
    from the indices the placements give this rank (a probe of `size` integers per dim, split
    as the tensor is). Ordinary strided shards (FSDP over a TP shard) hold one box: False."""
    if not isinstance(t, DTensor):
        return False
    strided = _compat.strided_shard_type()
    if not any(isinstance(p, strided) for p in t.placements):
        return False  # Shard / Replicate only: one box, which DCP computes
    device = t.to_local().device
    for dim, size in enumerate(t.shape):
        probe = []
        for p in t.placements:
            if isinstance(p, strided) and p.dim % t.ndim == dim:  # not a Shard subclass on every torch
                probe.append(_compat.strided_shard(0, p.split_factor))
            elif isinstance(p, Shard) and p.dim % t.ndim == dim:
                probe.append(Shard(0))
            else:
                probe.append(Replicate())
        held = distribute_tensor(torch.arange(size, device=device), t.device_mesh, probe, src_data_rank=None).to_local()
        if held.numel() and not torch.equal(held, torch.arange(int(held[0]), int(held[0]) + held.numel(), device=device)):
            return True
    return False


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


def whole_for_load(state: Any, keys: set[str]) -> dict[str, tuple[Any, Any, torch.Tensor, torch.Tensor]]:
    """Replace, in `state` itself (DCP also loads the non-tensor entries into it), the DTensors
    at `keys` by whole-size buffers for DCP to read into; `place_all` then copies each rank's
    part into the DTensor and puts it back. {key: (container, index, buffer, DTensor)}."""
    pairs = {}
    for path, t in _tensors(state):
        if _key(path) in keys and isinstance(t, DTensor):
            container = state
            for part in path[:-1]:
                container = container[part]
            if isinstance(container, tuple):
                raise CheckpointError(f"smp cannot read the packed tensor {_key(path)!r}: it sits in a tuple")
            buffer = torch.empty(t.shape, dtype=t.dtype)  # host memory: `place` moves one at a time
            container[path[-1]] = buffer
            pairs[_key(path)] = (container, path[-1], buffer, t)
    return pairs


def place_all(pairs: dict[str, tuple[Any, Any, torch.Tensor, torch.Tensor]], source: str) -> None:
    """After DCP's read: each buffer's part into its DTensor, which goes back into the state."""
    with torch.no_grad():
        for key, (container, index, whole, into) in pairs.items():
            place(whole, into, key, source)
            container[index] = into
