"""ParallelDims: the config's degrees turned into one named DeviceMesh, validated once.

Mesh axes, outermost first: ("dp_replicate", "dp_shard", "tp"). TP is innermost so that a
tensor-parallel group sits on adjacent ranks (one host, the fastest links); replication is
outermost so that only the gradient all-reduce of HSDP crosses the slowest links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from smp.config import ConfigError, SMPConfig

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, config: SMPConfig, world_size: int) -> "ParallelDims":
        tp = config.tensor_parallel_degree
        hybrid = config.hybrid_shard_degree
        degrees = (
            f"tensor_parallel_degree={tp}, hybrid_shard_degree={hybrid}, "
            f"context_parallel_degree={config.context_parallel_degree}, "
            f"expert_parallel_degree={config.expert_parallel_degree}, world_size={world_size}"
        )
        if world_size % tp:
            raise ConfigError(
                f"tensor_parallel_degree={tp} does not divide the world size {world_size} "
                f"({degrees}); choose a tensor_parallel_degree that divides {world_size}"
            )
        dp = world_size // tp
        if hybrid == 0:  # shard over every data-parallel rank
            dp_shard, dp_replicate = dp, 1
        elif dp % hybrid:
            raise ConfigError(
                f"hybrid_shard_degree={hybrid} does not divide the data-parallel size {dp} = "
                f"world_size / tensor_parallel_degree ({degrees}); use 0 (shard over all), 1 "
                f"(replicate) or a divisor of {dp}"
            )
        else:
            dp_shard, dp_replicate = hybrid, dp // hybrid
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def describe(self) -> str:
        return (
            f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard "
            f"{self.dp_shard} x tp {self.tp}"
        )

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 3-D mesh, and its flattened data-parallel axis "dp" (data loading, loss averaging)."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        dp_mesh = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        return mesh, dp_mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims, replicas_by_hook: bool = False) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D (replicate, shard) for native HSDP, else 1-D shard. With
    `replicas_by_hook` smp's all-reduce hook, not FSDP, syncs the replicas (see
    smp/sharding/gradient_sync.py): 1-D shard too. Every replica holds identical parameters."""
    if dims.dp_replicate > 1 and not replicas_by_hook:
        return mesh[("dp_replicate", "dp_shard")]
    return mesh["dp_shard"]


def device_type_for(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"
