"""Gradient synchronisation dispatch to smp_collectives. (Placeholder until issue #6 lands.)"""

from __future__ import annotations

from torch import nn

from smp.config import ConfigError, SMPConfig


def install_gradient_sync(model: nn.Module, runtime_state, config: SMPConfig) -> None:
    """Install custom collectives on every FSDP module of `model`, per `config.gradient_sync`."""
    sync = config.gradient_sync
    if sync.algorithm != "default" or sync.cross_replica != "default":
        raise ConfigError("gradient_sync other than 'default' is not available in this build yet")
