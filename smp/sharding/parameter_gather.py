"""Parameter gather: dispatch `config.parameter_gather` to smp_collectives (kernels/).

    algorithm     default -> FSDP2's own all-gather (exact), untouched
                  int8/fp8-> each unit's shard quantised in blocks (1-byte codes + an fp32 scale
                             per block), gathered, decoded into the parameter dtype:
                             ~0.51x the bf16 bytes (ZeRO++'s qwZ)
    hierarchical  false   -> as configured: with reshard_after_forward, backward gathers again
                             over the whole shard group
                  true/k  -> hpZ: after forward each block keeps its parameters sharded over
                             the k ranks of its node (FSDP2's reshard_after_forward=k, over one
                             node mesh built here for every block: `node_mesh`), and the
                             backward gather runs inside that group, exact (the values forward
                             already dequantised); true takes k from $LOCAL_WORLD_SIZE (torchrun).
                             Under HSDP the node is inside one replica's shard group.

Only the communicated copy is compressed: the sharded parameters the optimizer updates are not.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from smp._compat import fsdp_reshard_after_forward_onto, fsdp_sharded_data, fsdp_unit_params, root_mesh
from smp.errors import ConfigError
from smp.mesh import MESH_VIEWS

GATHERABLE = (torch.float32, torch.bfloat16, torch.float16)


def node_ranks(hierarchical: bool | int, shard_ranks: int) -> int | None:
    """The size of the in-node group backward gathers stay in (None: not hierarchical), checked
    against the `shard_ranks` each block is sharded over."""
    if hierarchical is False:
        return None
    if hierarchical is True:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            raise ConfigError(
                "parameter_gather.hierarchical: true takes the ranks per node from $LOCAL_WORLD_SIZE, which is not "
                "set (torchrun sets it); launch with torchrun or give the number: hierarchical: <ranks per node>"
            )
        k, where = int(local), f"$LOCAL_WORLD_SIZE={local}"
    else:
        k, where = hierarchical, f"hierarchical: {hierarchical}"
    if k >= shard_ranks or shard_ranks % k:
        raise ConfigError(
            f"parameter_gather.hierarchical: the in-node group ({where} ranks) must divide the {shard_ranks} ranks "
            f"each block is sharded over and be smaller"
            + (" (here every gather already stays inside one node); set hierarchical: false" if k >= shard_ranks
               else "; give a divisor of it")
        )
    return k


def gather_reshard_after_forward(reshard: bool | int, hierarchical: bool | int, shard_ranks: int) -> bool | int:
    """The blocks' `reshard_after_forward` for `fully_shard` with the hierarchical gather checked:
    True (reshard over the whole shard group), narrowed to the node afterwards by
    `install_parameter_gather`. Not the in-node size k: fully_shard would build each block's
    node groups from its own rank's slice of the mesh, which hangs where the shard group is a
    1-D slice of a larger world (replicas synced by smp's hook), see `node_mesh`."""
    k = node_ranks(hierarchical, shard_ranks)
    if k is None:
        return reshard
    if reshard is False:
        raise ConfigError(
            "parameter_gather.hierarchical keeps each block's parameters sharded inside the node after forward, "
            "but reshard_after_forward: false keeps them whole (no backward gather to keep in the node); "
            "drop one of them"
        )
    return True


# The blocks' FSDP shard axis (smp/mesh.py's fsdp_mesh): the only units hpZ narrows. Expert units
# shard over dp_shard_mod_ep, whose ranks are strided by ep: k of them in a row are not a node.
BLOCK_SHARD_AXIS = "dp_shard_cp"


def node_mesh(fsdp_mesh: DeviceMesh, k: int) -> DeviceMesh:
    """One 2-D mesh, the same on every rank: every FSDP shard group of the world (each replica's,
    each tp / pp coordinate's) cut into rows of k consecutive ranks, one row per node. Dim 1 is
    the group a block's backward gather stays in; dim 0 (unused) joins the rows."""
    root = root_mesh(fsdp_mesh)
    names = root.mesh_dim_names
    axis = [names.index(d) for d in MESH_VIEWS.get(BLOCK_SHARD_AXIS, (BLOCK_SHARD_AXIS,))]
    rest = [i for i in range(len(names)) if i not in axis]
    rows = root.mesh.permute(*rest, *axis).reshape(-1, k)
    return DeviceMesh(fsdp_mesh.device_type, rows)


def install_parameter_gather(model: nn.Module, algorithm: str, *, block_size: int, hierarchical: bool | int,
                             param_dtype: torch.dtype | None) -> int:
    """Install `smp_collectives.ParameterAllGather` on every FSDP unit of `model`; returns the
    number of units it went on. `param_dtype`: the mixed-precision all-gather dtype (None: the
    parameters' own). Refuses (ConfigError) where nothing would be gathered or compressed."""
    if algorithm == "default" and hierarchical is False:
        return 0
    import smp_collectives as sc

    units = [(m, fsdp_unit_params(m)) for m in model.modules() if isinstance(m, FSDPModule)]
    units = [(m, params) for m, params in units if params]
    sizes = {params[0].mesh_info.shard_mesh_size for _, params in units}
    if not units or sizes == {1}:
        raise ConfigError(
            f"parameter_gather (algorithm: {algorithm}, hierarchical: {hierarchical}) compresses the FSDP parameter "
            f"all-gather, but no FSDP unit here is sharded over more than one rank (world size 1, or tensor / "
            f"pipeline parallelism takes every rank): nothing is gathered; set parameter_gather: default"
        )
    for module, params in units:
        for fp in params:
            dtype = param_dtype or fsdp_sharded_data(fp).dtype
            if dtype not in GATHERABLE:
                raise ConfigError(
                    f"parameter_gather: {algorithm} quantises fp32 / bf16 / fp16 parameters; {type(module).__name__} "
                    f"gathers {dtype} (already 8-bit parameters are not quantised again); set parameter_gather: default"
                )
    kind = None if algorithm == "default" else algorithm
    for module, params in units:
        n = params[0].mesh_info.shard_mesh_size
        if n > 1:
            module.set_custom_all_gather(sc.ParameterAllGather(kind, block_size, compress_ranks=n))
    if hierarchical is not False:
        _narrow_to_node(units, hierarchical)
    return len(units)


def _narrow_to_node(units: list, hierarchical: bool | int) -> None:
    """hpZ: the blocks that reshard after forward keep their shards over the node (one mesh for
    every block, `node_mesh`); their backward gather then runs there, exact."""
    def on_block_axis(info) -> bool:
        return (info.mesh.mesh_dim_names or ())[info.shard_mesh_dim:][:1] == (BLOCK_SHARD_AXIS,)

    blocks = [(m, params) for m, params in units
              if params[0].post_forward_mesh_info is not None and on_block_axis(params[0].mesh_info)]
    if not blocks:
        return
    info = blocks[0][1][0].mesh_info
    mesh = node_mesh(info.mesh, node_ranks(hierarchical, info.shard_mesh_size))
    for module, _ in blocks:
        fsdp_reshard_after_forward_onto(module, mesh)


def parameter_gather_bytes(reset: bool = False) -> dict[str, int]:
    """Bytes this rank sent in parameter all-gathers through smp_collectives since the last reset
    ("param_gather.int8" / ".fp8": quantised; ".exact": exact gathers, e.g. hpZ's in-node one),
    plus "total". FSDP2's own all-gather (algorithm default, not hierarchical) is not counted."""
    from smp_collectives import counters

    table = {name: v["bytes"] for name, v in counters.snapshot().items() if name.startswith("param_gather.")}
    table["total"] = sum(table.values())
    if reset:
        counters.reset()
    return table
