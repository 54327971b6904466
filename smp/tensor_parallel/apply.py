"""Apply a tensor-parallel plan. (Placeholder until issue #3 lands.)"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smp.config import ConfigError, SMPConfig


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, config: SMPConfig, plan: dict | None = None) -> nn.Module:
    raise ConfigError(
        f"tensor_parallel_degree={config.tensor_parallel_degree}: tensor parallelism is not "
        "available in this build yet; set tensor_parallel_degree: 1"
    )
