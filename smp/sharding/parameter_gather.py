"""Parameter gather: dispatch `config.parameter_gather` to smp_collectives (kernels/).

    algorithm     default -> FSDP2's own all-gather (exact), untouched
                  int8/fp8-> each unit's shard quantised in blocks (1-byte codes + an fp32 scale
                             per block), gathered, decoded into the parameter dtype:
                             ~0.51x the bf16 bytes (ZeRO++'s qwZ)
    hierarchical  false   -> as configured: with reshard_after_forward, backward gathers again
                             over the whole shard group
                  true/k  -> hpZ: after forward each block keeps its parameters sharded over
                             the k ranks of its node (FSDP2's reshard_after_forward=k), and the
                             backward gather runs inside that group, exact (the values forward
                             already dequantised); true takes k from $LOCAL_WORLD_SIZE (torchrun).

Only the communicated copy is compressed: the sharded parameters the optimizer updates are not.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from smp._compat import fsdp_sharded_data, fsdp_unit_params
from smp.errors import ConfigError

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
    """The blocks' `reshard_after_forward` with the hierarchical gather: the in-node group size
    (FSDP2 keeps the post-forward shards over it and gathers them there in backward)."""
    k = node_ranks(hierarchical, shard_ranks)
    if k is None:
        return reshard
    if reshard is False:
        raise ConfigError(
            "parameter_gather.hierarchical keeps each block's parameters sharded inside the node after forward, "
            "but reshard_after_forward: false keeps them whole (no backward gather to keep in the node); "
            "drop one of them"
        )
    return k


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
    return len(units)


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
