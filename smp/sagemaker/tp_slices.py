"""SMP v2's sharded state dict under tensor parallelism: each TP rank's slice is a whole tensor.

Under SMP v2, a tensor-parallel rank held its slice of each TP-split parameter as an ordinary
tensor, and FSDP1 sharded that slice over `model.process_group` (the data-parallel ranks of one
TP rank). So `model.state_dict()` inside `FSDP.state_dict_type(model, SHARDED_STATE_DICT)` held,
per TP rank, tensors whose global shape is the slice, and SMP v2 scripts save them into one folder
per TP rank (`<dir>/tp<T>-<tp_rank>`) with `save_state_dict(..., process_group=model.process_group)`.

smp's state dict holds DTensors over (data parallel, tp): global tensors. Given to DCP over the
data-parallel group, their chunks cover only this TP rank's slice, and DCP refuses the plan
("invalid fill tensor-volume"). `to_slice` gives such a DTensor as SMP v2 did: a DTensor over the
data-parallel axis alone whose global shape is this TP rank's slice, holding the same local tensor
(no copy; a load into it writes into the parameter). `from_slice` puts a loaded slice back on the
parameter's own layout. Both are exact: only the description of the local tensor changes.
`local_part` takes this rank's part of a whole slice (what torch's sharded optimizer loader reads)
onto the parameter's layout: a local cut, exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

TP = "tp"


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` of `size` cut as torch.chunk / DTensor's Shard cut it."""
    step = -(-size // parts) if size else 0
    offset = min(step * index, size)
    return offset, min(step, size - offset)


def slice_shape(t: DTensor) -> list[int] | None:
    """This TP rank's slice of `t`'s global shape (None when `t` is not on a tp axis of size > 1)."""
    names = t.device_mesh.mesh_dim_names or ()
    if TP not in names or t.device_mesh.size(names.index(TP)) == 1:
        return None
    axis = names.index(TP)
    shape = list(t.shape)
    placement = t.placements[axis]
    if isinstance(placement, Shard):
        tp_rank = t.device_mesh.get_local_rank(TP)
        shape[placement.dim] = _chunk(shape[placement.dim], t.device_mesh.size(axis), tp_rank)[1]
    elif not isinstance(placement, Replicate):  # (Partial: never in a state dict)
        raise ValueError(f"a state-dict tensor placed {placement} on the tp axis cannot be saved per TP rank")
    return shape


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def to_slice(t: Any, shard_mesh: DeviceMesh) -> Any:
    """`t` as SMP v2 held it: over `shard_mesh` (the data-parallel axis of `model.process_group`)
    with this TP rank's slice as its global tensor. Anything not on a tp axis comes back as is."""
    if not isinstance(t, DTensor):
        return t
    shape = slice_shape(t)
    if shape is None:
        return t
    return DTensor.from_local(t.to_local(), device_mesh=shard_mesh, placements=[_data_parallel_placement(t, shard_mesh)],
                              run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _data_parallel_placement(t: DTensor, shard_mesh: DeviceMesh) -> Any:
    """How `t` is cut over `shard_mesh`'s ranks: FSDP shards dim 0 of the TP slice (a _StridedShard
    when TP splits dim 0 too: the TP cut comes first, then the data-parallel one, which is Shard(0)
    of the slice). Replicated axes (HSDP's replicas) are not part of the slice's layout."""
    mesh, names = t.device_mesh, t.device_mesh.mesh_dim_names or ()
    cut = [i for i, p in enumerate(t.placements) if names[i] != TP and not isinstance(p, Replicate)]
    if not cut:
        return Replicate()
    wanted = sorted(dist.get_process_group_ranks(shard_mesh.get_group()))
    if len(cut) > 1 or sorted(dist.get_process_group_ranks(mesh.get_group(cut[0]))) != wanted:
        raise ValueError(f"a state-dict tensor on mesh axes {names} with placements {t.placements} is not cut over "
                         f"model.process_group (ranks {wanted}) alone; it cannot be saved per TP rank")
    return Shard(t.placements[cut[0]].dim)


def from_slice(view: Any, like: DTensor) -> Any:
    """A slice `to_slice` made (and a load filled) back on `like`'s layout; anything else as is."""
    if not (isinstance(view, DTensor) and isinstance(like, DTensor)) or view.device_mesh == like.device_mesh:
        return view
    local = view.to_local()
    if tuple(local.shape) != tuple(like.to_local().shape):
        raise ValueError(f"a per-TP-rank slice of local shape {tuple(local.shape)} does not fit the parameter's "
                         f"local shape {tuple(like.to_local().shape)}")
    return DTensor.from_local(local, device_mesh=like.device_mesh, placements=like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def state_to_slices(state: Any, shard_mesh: DeviceMesh) -> Any:
    """Every DTensor of a (nested) state dict as its TP slice."""
    if isinstance(state, dict):
        return {k: state_to_slices(v, shard_mesh) for k, v in state.items()}
    if isinstance(state, list):
        return [state_to_slices(v, shard_mesh) for v in state]
    return to_slice(state, shard_mesh)


def local_part(whole_slice: torch.Tensor, like: DTensor, shard_mesh: DeviceMesh) -> DTensor:
    """`whole_slice` (this TP rank's slice of a tensor laid out as `like`, whole) as `like` holds
    it: this rank's part (cut locally, no communication) on `like`'s layout."""
    view = to_slice(like, shard_mesh)
    if tuple(whole_slice.shape) != tuple(view.shape):
        raise ValueError(f"a per-TP-rank slice of shape {tuple(whole_slice.shape)} does not fit this TP rank's "
                         f"slice {tuple(view.shape)} of a parameter of shape {tuple(like.shape)}")
    part = distribute_tensor(whole_slice, view.device_mesh, view.placements, src_data_rank=None)
    return from_slice(part, like)
