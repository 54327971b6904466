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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from smp.config import SMPConfig
from smp.mesh import ParallelDims, fsdp_mesh


def replicas_by_hook(config: SMPConfig, dims: ParallelDims) -> bool:
    """True when smp, not native HSDP, syncs gradients across replica groups."""
    return config.gradient_sync.cross_replica != "default" and dims.dp_replicate > 1


def gradient_sync_mesh(mesh: DeviceMesh, dims: ParallelDims, config: SMPConfig) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D "dp_shard" when the replica hop is smp's hook, else
    `fsdp_mesh` (2-D for native HSDP). Both keep identical parameters on every replica."""
    if replicas_by_hook(config, dims):
        return mesh["dp_shard"]
    return fsdp_mesh(mesh, dims)


def install_gradient_sync(model: nn.Module, runtime_state, config: SMPConfig) -> None:
    """Install custom collectives on every FSDP module of `model`, per `config.gradient_sync`."""
    sync = config.gradient_sync
    by_hook = replicas_by_hook(config, runtime_state.dims)
    if sync.algorithm == "default" and not by_hook:
        return  # nothing to replace: FSDP keeps the process group's collectives
    import smp_collectives as sc

    replica_group = runtime_state.mesh["dp_replicate"].get_group() if by_hook else None
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        if sync.algorithm == "ring":
            unit.set_custom_reduce_scatter(sc.RingReduceScatter())
            unit.set_custom_all_gather(sc.RingAllGather())
        elif sync.algorithm in ("int8", "fp8"):
            # Parameters are all-gathered exactly (default all-gather); only gradients are lossy.
            unit.set_custom_reduce_scatter(
                sc.QuantizedReduceScatter(sync.algorithm, sync.block_size, sync.error_feedback)
            )
        if by_hook:
            kind = None if sync.cross_replica == "ring" else sync.cross_replica
            unit.set_all_reduce_hook(
                sc.CrossReplicaAllReduce(replica_group, kind, sync.block_size, sync.error_feedback)
            )


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
