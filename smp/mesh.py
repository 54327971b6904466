"""ParallelDims: the config's degrees turned into one named DeviceMesh, validated once.

Every axis always exists, size 1 when its parallelism is off (torchtitan's ParallelDims): the
mesh is pp x dp_replicate x dp_shard_mod_ep x ep x cp x tp, outermost first, and a lookup
(`mesh["cp"]`, `smp.state.ep_rank`) never finds an axis missing. A caller branches on a degree
only where a degree of 1 means "no collective to run", never on whether an axis exists.

- tp is innermost, so that a tensor-parallel group sits on adjacent ranks (one host, the
  fastest links); replication is outermost among the data-parallel axes, so that only HSDP's
  gradient all-reduce crosses the slowest links.
- pp is outermost (torchtitan's order): only activations cross it, once per micro-batch and
  stage boundary. Every other axis is sliced within one stage: mesh["dp_shard"] on a rank is its
  stage's FSDP group.
- cp ranks come out of the data-parallel ranks (world / tp): a cp group shares its batch rows
  ("dp" = dp_replicate x dp_shard says which rows a rank gets) and FSDP shards over dp_shard x cp
  together ("dp_shard_cp", torchtitan's layout), so gradients are reduced over every rank that saw
  part of the batch. hybrid_shard_degree counts that shard group, cp included.
- ep borrows its ranks from dp_shard, as torchtitan and Megatron do: "dp_shard" is a view, the
  flattened (dp_shard_mod_ep, ep), so non-expert parameters are FSDP-sharded over every
  data-parallel rank while expert parameters (split over "ep") are FSDP-sharded over what is
  left (`expert_fsdp_mesh`). ep is innermost in dp_shard: the all-to-alls stay on adjacent ranks.

The views (flattened axes), each always present too: "dp_shard" = dp_shard_mod_ep x ep,
"dp" = dp_replicate x dp_shard (data loading, loss averaging), "dp_shard_cp" = dp_shard x cp
(FSDP's shard group).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from smp._compat import flatten_mesh
from smp.composition import check_world
from smp.config import ConfigError, SMPConfig

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
# name -> the axes it flattens, in the order they are built (a view may flatten an earlier view)
# Each view flattens root axes only: torch 2.11 cannot slice a flattened view together with
# another axis ("Mesh dim indices should be in ascending order").
MESH_VIEWS = {"dp_shard": ("dp_shard_mod_ep", "ep"), "dp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
              "dp_shard_cp": ("dp_shard_mod_ep", "ep", "cp")}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    cp: int = 1
    ep: int = 1
    pp: int = 1

    @classmethod
    def from_config(cls, config: SMPConfig, world_size: int) -> "ParallelDims":
        tp = config.tensor_parallel_degree
        hybrid = config.hybrid_shard_degree
        pp = config.pipeline_parallel_degree
        degrees = (
            (f"pipeline_parallel_degree={pp}, " if pp > 1 else "")
            + f"tensor_parallel_degree={tp}, hybrid_shard_degree={hybrid}, "
            f"context_parallel_degree={config.context_parallel_degree}, "
            f"expert_parallel_degree={config.expert_parallel_degree}, world_size={world_size}"
        )
        if world_size % pp:
            raise ConfigError(
                f"pipeline_parallel_degree={pp} does not divide the world size {world_size} ({degrees}); "
                f"world = pp x dp_replicate x dp_shard x cp x tp: choose a pipeline_parallel_degree "
                f"that divides {world_size}"
            )
        full_world, world_size = world_size, world_size // pp  # the other axes live inside a stage
        ranks = f"the world size {world_size}" if pp == 1 else f"the {world_size} ranks of each pipeline stage"
        if world_size % tp:
            raise ConfigError(
                f"tensor_parallel_degree={tp} does not divide {ranks} "
                f"({degrees}); choose a tensor_parallel_degree that divides {world_size}"
            )
        dp = world_size // tp
        cp = config.context_parallel_degree
        if dp % cp:
            raise ConfigError(
                f"context_parallel_degree={cp} does not divide the data-parallel size {dp} = "
                f"world_size / tensor_parallel_degree ({degrees}); cp ranks come out of the "
                f"data-parallel ranks: world = dp_replicate x dp_shard x cp x tp"
            )
        if hybrid == 0:  # shard over every data-parallel rank
            dp_shard, dp_replicate = dp // cp, 1
        elif dp % hybrid:
            raise ConfigError(
                f"hybrid_shard_degree={hybrid} does not divide the data-parallel size {dp} = "
                f"world_size / tensor_parallel_degree ({degrees}); use 0 (shard over all), 1 "
                f"(replicate) or a divisor of {dp}"
                + (f" that is a multiple of context_parallel_degree={cp} (FSDP shards over the cp "
                   f"ranks too)" if cp > 1 else "")
            )
        elif hybrid % cp:
            multiples = [m for m in range(cp, dp + 1, cp) if dp % m == 0]
            raise ConfigError(
                f"hybrid_shard_degree={hybrid} is not a multiple of context_parallel_degree={cp} "
                f"({degrees}): FSDP shards over the cp ranks too, so each shard group holds whole cp "
                f"groups; use 0 (shard over all) or one of {multiples} (multiples of {cp} that divide "
                f"the data-parallel size {dp})"
            )
        else:
            dp_shard, dp_replicate = hybrid // cp, dp // hybrid
        ep = config.expert_parallel_degree
        if dp_shard % ep:
            raise ConfigError(
                f"expert_parallel_degree={ep} does not divide the data-parallel shard size {dp_shard} "
                f"({degrees}); expert-parallel ranks come out of the sharded data-parallel ranks: "
                f"choose an expert_parallel_degree that divides {dp_shard}"
            )
        dims = cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=full_world, cp=cp, ep=ep, pp=pp)
        check_world(config, dims)  # what composes at this world size: smp/composition.py
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return MESH_DIM_NAMES

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)

    def size(self, axis: str) -> int:
        """The size of mesh axis or view `axis` (a name of MESH_DIM_NAMES or MESH_VIEWS)."""
        if axis in MESH_VIEWS:
            return math.prod(self.size(part) for part in MESH_VIEWS[axis])
        return self.shape[MESH_DIM_NAMES.index(axis)]

    def describe(self) -> str:
        pp = f"pp {self.pp} x " if self.pp > 1 else ""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        ep = f" (of which ep {self.ep})" if self.ep > 1 else ""
        return (
            f"world {self.world_size} = {pp}dp_replicate {self.dp_replicate} x dp_shard "
            f"{self.dp_shard}{ep}{cp} x tp {self.tp}"
        )

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The mesh with every axis and view of MESH_DIM_NAMES / MESH_VIEWS, and its view "dp"."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.mesh_dim_names)
        views = {name: flatten_mesh(mesh, axes, name) for name, axes in MESH_VIEWS.items()}
        return mesh, views["dp"]


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims, replicas_by_hook: bool = False) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D (replicate, shard) for native HSDP, else 1-D shard. With
    `replicas_by_hook` smp's all-reduce hook, not FSDP, syncs the replicas (see
    smp/sharding/gradient_sync.py): 1-D shard too. Every replica holds identical parameters.
    "Shard" is dp_shard x cp: under context parallel a cp group's gradients are partial sums.
    (A replicate axis of size 1 is left out: FSDP then shards 1-D, not HSDP over one replica.)"""
    if dims.dp_replicate > 1 and not replicas_by_hook:
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh["dp_shard_cp"]


def expert_fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards expert parameters over (they are already split over "ep"):
    dp_shard_mod_ep, with dp_replicate in front under hybrid sharding."""
    if dims.dp_replicate > 1:
        return mesh[("dp_replicate", "dp_shard_mod_ep")]
    return mesh["dp_shard_mod_ep"]


def device_type_for(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"
