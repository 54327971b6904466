"""ParallelDims: the config's degrees turned into one named DeviceMesh, validated once.

Mesh axes, outermost first: ("dp_replicate", "dp_shard", "tp"). TP is innermost so that a
tensor-parallel group sits on adjacent ranks (one host, the fastest links); replication is
outermost so that only the gradient all-reduce of HSDP crosses the slowest links.

Context parallel (cp > 1) adds a "cp" axis between dp_shard and tp: world = dp_replicate x
dp_shard x cp x tp. The cp ranks come out of the data-parallel ranks (world / tp): a cp group
shares its batch rows ("dp" = dp_replicate x dp_shard still says which rows a rank gets) and
FSDP shards over dp_shard x cp together ("dp_shard_cp", torchtitan's layout), so gradients are
reduced over every rank that saw part of the batch. hybrid_shard_degree counts that shard group,
cp included. With cp = 1 the mesh is the 3-D one, unchanged.

Expert parallel (ep > 1) borrows its ranks from dp_shard, as torchtitan and Megatron do: the
mesh is dp_replicate x dp_shard_mod_ep x ep x tp, and "dp_shard" is the flattened
(dp_shard_mod_ep, ep), so non-expert parameters are FSDP-sharded over every data-parallel rank
as before while expert parameters (split over "ep") are FSDP-sharded over what is left
(`expert_fsdp_mesh`). ep is innermost in dp_shard: the all-to-alls stay on adjacent ranks.

Pipeline parallel (pp > 1) adds a "pp" axis outermost (torchtitan's order): world = pp x
dp_replicate x dp_shard x cp x tp. Only activations cross it, once per micro-batch and stage
boundary, so it is the axis that best tolerates the slowest links (between nodes). Every other
axis is sliced within one stage: mesh["dp_shard"] on a rank is its stage's FSDP group. With pp = 1
the mesh has no "pp" axis, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from smp._compat import flatten_mesh
from smp.config import SPLIT_BACKWARD_SCHEDULES, ConfigError, SMPConfig

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


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
        if ep > 1 and (tp > 1 or cp > 1):
            raise ConfigError(
                f"expert_parallel_degree={ep} with tensor_parallel_degree={tp} / context_parallel_"
                f"degree={cp} > 1 is not supported by smp (SMP v2 cannot combine them either); "
                f"set tensor_parallel_degree and context_parallel_degree to 1 ({degrees})"
            )
        if dp_shard % ep:
            raise ConfigError(
                f"expert_parallel_degree={ep} does not divide the data-parallel shard size {dp_shard} "
                f"({degrees}); expert-parallel ranks come out of the sharded data-parallel ranks: "
                f"choose an expert_parallel_degree that divides {dp_shard}"
            )
        schedule = config.pipeline.schedule
        resharded = "reshard_after_forward" in config.model_fields_set and config.reshard_after_forward is not False
        if pp > 1 and dp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES and resharded:
            # The weight half of a micro-batch's backward can run after a later micro-batch's
            # forward resharded the unit: its gradients then miss FSDP's reduction (measured:
            # gradients off by 3e-2 at PP 2 x FSDP 2, dualpipev). Kept gathered through the step
            # (smp's default under pp) they are exact.
            raise ConfigError(
                f"pipeline.schedule {schedule!r} with {dp} data-parallel ranks per stage and "
                f"reshard_after_forward={config.reshard_after_forward!r} is not supported ({degrees}): the "
                f"schedule runs each micro-batch's weight gradients after later forwards, when FSDP has "
                f"resharded the parameters they belong to; leave reshard_after_forward unset (false under "
                f"pipeline parallelism) or pick gpipe / 1f1b / interleaved_1f1b / looped_bfs"
            )
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=full_world, cp=cp, ep=ep, pp=pp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        pp = ("pp",) if self.pp > 1 else ()
        if self.ep > 1:
            return pp + ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
        return pp + (MESH_DIM_NAMES if self.cp == 1 else ("dp_replicate", "dp_shard", "cp", "tp"))

    @property
    def shape(self) -> tuple[int, ...]:
        pp = (self.pp,) if self.pp > 1 else ()
        if self.ep > 1:
            return pp + (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
        if self.cp == 1:
            return pp + (self.dp_replicate, self.dp_shard, self.tp)
        return pp + (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def describe(self) -> str:
        pp = f"pp {self.pp} x " if self.pp > 1 else ""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        ep = f" (of which ep {self.ep})" if self.ep > 1 else ""
        return (
            f"world {self.world_size} = {pp}dp_replicate {self.dp_replicate} x dp_shard "
            f"{self.dp_shard}{ep}{cp} x tp {self.tp}"
        )

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The mesh, and its flattened data-parallel axis "dp" (data loading, loss averaging).
        With cp > 1 also the flattened FSDP axis "dp_shard_cp" (see `fsdp_mesh`)."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.mesh_dim_names)
        if self.ep > 1:
            flatten_mesh(mesh, ("dp_shard_mod_ep", "ep"), "dp_shard")
        dp_mesh = flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")
        if self.cp > 1:
            flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        return mesh, dp_mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims, replicas_by_hook: bool = False) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D (replicate, shard) for native HSDP, else 1-D shard. With
    `replicas_by_hook` smp's all-reduce hook, not FSDP, syncs the replicas (see
    smp/sharding/gradient_sync.py): 1-D shard too. Every replica holds identical parameters.
    Under context parallel "shard" is dp_shard x cp: a cp group's gradients are partial sums."""
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    if dims.dp_replicate > 1 and not replicas_by_hook:
        return mesh[("dp_replicate", shard)]
    return mesh[shard]


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
