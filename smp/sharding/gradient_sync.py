"""Gradient synchronisation: dispatch `config.gradient_sync` to smp_collectives (kernels/).

    algorithm      default -> the process group's own reduce-scatter (NCCL / gloo), untouched
                   ring    -> ring reduce-scatter + all-gather over point-to-point (reference)
                   int8/fp8-> block-quantised reduce-scatter (~0.25x / bytes), error feedback
    cross_replica  (hybrid sharding only) default -> native HSDP all-reduce across replicas;
                   ring/int8/fp8 -> FSDP shards over the 1-D "dp_shard" mesh and the replicas
                   are averaged by smp's all-reduce hook, so only that hop is compressed.

Each FSDP unit gets its own comm objects: error-feedback residuals are per module.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from smp.mesh import ParallelDims


def replicas_by_hook(cross_replica: str, dims: ParallelDims) -> bool:
    """True when smp, not native HSDP, syncs gradients across replica groups."""
    return cross_replica != "default" and dims.dp_replicate > 1


def install_gradient_sync(
    model: nn.Module,
    algorithm: str,
    *,
    block_size: int,
    error_feedback: bool,
    cross_replica: str = "default",
    replica_group: dist.ProcessGroup | None = None,
) -> None:
    """Install custom collectives on every FSDP module of `model` (the config's `gradient_sync`
    documents each value). `replica_group`: the group across replicas that smp's all-reduce hook
    averages over, with `cross_replica` as its algorithm; None when FSDP (native HSDP) does it,
    or there are no replicas (see `replicas_by_hook`)."""
    if algorithm == "default" and replica_group is None:
        return  # nothing to replace: FSDP keeps the process group's collectives
    import smp_collectives as sc

    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        if algorithm == "ring":
            unit.set_custom_reduce_scatter(sc.RingReduceScatter())
            unit.set_custom_all_gather(sc.RingAllGather())
        elif algorithm in ("int8", "fp8"):
            # Parameters are all-gathered exactly (default all-gather); only gradients are lossy.
            unit.set_custom_reduce_scatter(sc.QuantizedReduceScatter(algorithm, block_size, error_feedback))
        if replica_group is not None:
            kind = None if cross_replica == "ring" else cross_replica
            unit.set_all_reduce_hook(sc.CrossReplicaAllReduce(replica_group, kind, block_size, error_feedback))


def gradient_sync_bytes(reset: bool = False) -> dict[str, int]:
    """Bytes this rank sent through smp_collectives since the last reset, per collective, plus
    "total". Call with reset=True once per step to read bytes per rank per step. The "default"
    algorithm uses the process group's own collectives, which are not instrumented (0 here);
    `smp_collectives.fp32_bytes_bound` gives their bandwidth-optimal equivalent.
    """
    from smp_collectives import counters

    table = {name: v["bytes"] for name, v in counters.snapshot().items()}
    table["total"] = sum(table.values())
    if reset:
        counters.reset()
    return table
