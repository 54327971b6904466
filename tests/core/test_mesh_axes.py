"""Every mesh axis always exists (smp/mesh.py): size 1 when its parallelism is off, so lookups
never miss; and each process group holds the same ranks as the layout before, when axes of
size 1 were left out of the mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from smp.config import load_config
from smp.mesh import MESH_DIM_NAMES, MESH_VIEWS, ParallelDims

CONFIGS = [
    ({}, 8),
    ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, 8),
    ({"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 8),
    ({"context_parallel_degree": 2, "hybrid_shard_degree": 2}, 8),
    ({"expert_parallel_degree": 2, "hybrid_shard_degree": 4}, 16),
    ({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 8),
    ({"pipeline_parallel_degree": 2, "context_parallel_degree": 2}, 4),
]


def _groups(layout: torch.Tensor, names: tuple[str, ...], axes: tuple[str, ...]) -> set[tuple[int, ...]]:
    """The rank groups of `axes` (flattened in order) in a rank layout with dimensions `names`."""
    dims = [names.index(a) for a in axes]
    rest = [d for d in range(layout.dim()) if d not in dims]
    size = 1
    for d in dims:
        size *= layout.shape[d]
    return {tuple(g) for g in layout.permute(rest + dims).reshape(-1, size).tolist()}


def _layout_before(dims: ParallelDims) -> tuple[torch.Tensor, tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The layout smp built before every axis existed: pp only when > 1, ep's split of dp_shard
    only when ep > 1, cp only when > 1 (and its views' axes)."""
    names = (("pp",) if dims.pp > 1 else ()) + ("dp_replicate",)
    names += ("dp_shard_mod_ep", "ep") if dims.ep > 1 else ("dp_shard",)
    names += (("cp",) if dims.cp > 1 else ()) + ("tp",)
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
             "dp_shard_mod_ep": dims.dp_shard // dims.ep, "ep": dims.ep, "cp": dims.cp, "tp": dims.tp}
    layout = torch.arange(dims.world_size).reshape([sizes[n] for n in names])
    shard = ("dp_shard_mod_ep", "ep") if dims.ep > 1 else ("dp_shard",)
    axes = {"dp_shard": shard, "dp": ("dp_replicate", *shard), "dp_shard_cp": shard + (("cp",) if dims.cp > 1 else ()),
            **{n: (n,) if n in names else () for n in ("pp", "dp_replicate", "ep", "cp", "tp")}}
    return layout, names, axes


def _axes_now(name: str) -> tuple[str, ...]:
    if name in MESH_VIEWS:
        return tuple(a for part in MESH_VIEWS[name] for a in _axes_now(part))
    return (name,)


@pytest.mark.parametrize("config,world", CONFIGS, ids=[str(c) for c, _ in CONFIGS])
def test_every_axis_has_the_ranks_it_had(config, world):
    dims = ParallelDims.from_config(load_config(config), world)
    assert dims.mesh_dim_names == MESH_DIM_NAMES and len(dims.shape) == len(MESH_DIM_NAMES)
    now = torch.arange(world).reshape(dims.shape)
    before, names, axes = _layout_before(dims)
    for name, old_axes in axes.items():
        singletons = {(r,) for r in range(world)}
        expected = _groups(before, names, old_axes) if old_axes else singletons
        assert _groups(now, MESH_DIM_NAMES, _axes_now(name)) == expected, name
        assert dims.size(name) == len(next(iter(expected))), name


def test_a_misplaced_axis_changes_the_groups():
    """Negative control: ep outside dp_shard_mod_ep (not innermost in dp_shard) puts other ranks
    in an ep group, which the comparison above sees."""
    dims = ParallelDims.from_config(load_config({"expert_parallel_degree": 2, "hybrid_shard_degree": 4}), 16)
    before, names, _ = _layout_before(dims)
    swapped = ("pp", "dp_replicate", "ep", "dp_shard_mod_ep", "cp", "tp")
    shape = [dims.size(n) for n in swapped]
    assert _groups(torch.arange(16).reshape(shape), swapped, ("ep",)) != _groups(before, names, ("ep",))


def test_built_mesh_finds_every_axis():
    """On a fake process group (rank 5 of 16): every axis and view exists with its size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        for config in ({}, {"expert_parallel_degree": 2, "hybrid_shard_degree": 4},
                       {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2},
                       {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "hybrid_shard_degree": 2}):
            dims = ParallelDims.from_config(load_config(config), 16)
            mesh, dp_mesh = dims.build_mesh("cpu")
            for name in (*MESH_DIM_NAMES, *MESH_VIEWS):
                assert mesh[name].size() == dims.size(name), (config, name)
            assert dp_mesh.size() == dims.dp
    finally:
        dist.destroy_process_group()
