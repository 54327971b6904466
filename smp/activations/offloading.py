"""Activation offloading. (Placeholder until issue #4 lands: refuses what it cannot do.)"""

from __future__ import annotations

from torch import nn

from smp.config import ConfigError, SMPConfig


def apply_activation_offloading(model: nn.Module, blocks: list[nn.Module], config: SMPConfig) -> None:
    if config.sm_activation_offloading:
        raise ConfigError("sm_activation_offloading is not available in this build yet; set it to false")
