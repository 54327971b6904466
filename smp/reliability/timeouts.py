"""Collective timeouts from the config, on every process group smp uses.

Two gaps in torch's defaults that turn a dead rank into a long hang or a flaky start:
- `init_process_group(timeout=...)` sets the timeout of the default group only. The device
  mesh's sub-groups (HSDP replicate/shard axes, TP, the flattened "dp" axis) are made by
  `new_group` with torch's default instead: 30 minutes on gloo, 10 on NCCL. smp sets
  `collective_timeout_seconds` on each of them after building the mesh.
- The same timeout also bounds the rendezvous, where ranks legitimately arrive seconds or
  minutes apart (imports, container start, a slow node). A short collective timeout (seconds,
  to fail fast) then makes start-up fail. smp joins with at least `RENDEZVOUS_TIMEOUT_SECONDS`
  and lowers the timeout to the configured value once every rank is in.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smp._compat import group_timeout, set_group_timeout

# Long enough for ranks started minutes apart by a cluster scheduler to meet.
RENDEZVOUS_TIMEOUT_SECONDS = 300.0


def rendezvous_timeout(collective_timeout_seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(collective_timeout_seconds, RENDEZVOUS_TIMEOUT_SECONDS))


def apply_collective_timeout(
    seconds: float, meshes: list[DeviceMesh], *, include_default: bool
) -> list[dist.ProcessGroup]:
    """Set `seconds` on every process group of `meshes` (and the default group when smp owns it).

    A group the user created (the default one when they called init_process_group themselves)
    keeps the timeout they chose. Returns the groups changed.
    """
    timeout = datetime.timedelta(seconds=seconds)
    default = dist.group.WORLD
    groups: dict[int, dist.ProcessGroup] = {}
    if include_default:
        groups[id(default)] = default
    for mesh in meshes:
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if group is not default:
                groups[id(group)] = group
    for group in groups.values():
        set_group_timeout(group, timeout)
    return list(groups.values())


def group_timeouts(mesh: DeviceMesh) -> dict[str, float]:
    """{mesh dim name: timeout in seconds} of this rank's groups (for tests and diagnostics)."""
    out = {}
    for dim, name in enumerate(mesh.mesh_dim_names or range(mesh.ndim)):
        group = mesh.get_group(dim)
        out[str(name)] = group_timeout(group, _device(mesh)).total_seconds()
    return out


def _device(mesh: DeviceMesh):
    import torch

    return torch.device(mesh.device_type)
