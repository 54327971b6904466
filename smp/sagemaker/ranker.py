"""`tsm.state.ranker`: SMP v2's rank arithmetic, computed from smp's device mesh.

SMP's words on smp's mesh axes: a replica is one copy of the model (the "dp_replicate" axis
of HSDP); a rank's replication rank is which replica it is in; a replication group is the
ranks that hold the same shard in different replicas. Pure arithmetic on the mesh's rank
layout: no call here communicates.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smp.sagemaker._guide import not_supported

# SMP's axis words -> smp's mesh axes (outermost first). Under expert parallelism "dp_shard" is
# the flattened (dp_shard_mod_ep, ep). An axis the mesh lacks has degree 1.
_AXES = {
    "rep": [("dp_replicate",)], "shard": [("dp_shard",), ("dp_shard_mod_ep", "ep")],
    "tp": [("tp",)], "cp": [("cp",)], "ep": [("ep",)],
}


class Ranker:
    def __init__(self, mesh: DeviceMesh) -> None:
        self._layout = mesh.mesh  # global ranks, one tensor dim per mesh axis
        self._names = tuple(mesh.mesh_dim_names or ())

    def _dims(self, axis: str) -> list[int]:
        for names in _AXES[axis]:
            if all(n in self._names for n in names):
                return [self._names.index(n) for n in names]
        return []

    def _groups(self, axis: str) -> list[list[int]]:
        dims = self._dims(axis)
        rest = [d for d in range(self._layout.dim()) if d not in dims]
        size = 1
        for d in dims:
            size *= self._layout.shape[d]
        return self._layout.permute(rest + dims).reshape(-1, size).tolist()

    def _rank(self, axis: str, global_rank: int | None) -> int:
        rank = dist.get_rank() if global_rank is None else global_rank
        for group in self._groups(axis):
            if rank in group:
                return group.index(rank)
        raise ValueError(f"rank {rank} is not in this run's mesh (world size {self._layout.numel()})")

    # Replication: which replica a rank is in; the ranks holding the same shard across replicas.
    def get_rep_rank(self, global_rank: int | None = None) -> int:
        return self._rank("rep", global_rank)

    def get_rep_groups(self) -> list[list[int]]:
        return self._groups("rep")

    def get_rep_size(self) -> int:
        return len(self._groups("rep")[0])

    def get_shard_rank(self, global_rank: int | None = None) -> int:
        return self._rank("shard", global_rank)

    def get_shard_groups(self) -> list[list[int]]:
        return self._groups("shard")

    def get_tp_rank(self, global_rank: int | None = None) -> int:
        return self._rank("tp", global_rank)

    def get_tp_groups(self) -> list[list[int]]:
        return self._groups("tp")

    def get_cp_rank(self, global_rank: int | None = None) -> int:
        return self._rank("cp", global_rank)

    def get_cp_groups(self) -> list[list[int]]:
        return self._groups("cp")

    def get_ep_rank(self, global_rank: int | None = None) -> int:
        return self._rank("ep", global_rank)

    def get_ep_groups(self) -> list[list[int]]:
        return self._groups("ep")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        not_supported(
            f"torch.sagemaker.state.ranker.{name}", "state",
            "the ranker implements get_{rep,shard,tp,cp,ep}_rank(global_rank) and get_{...}_groups()",
        )
