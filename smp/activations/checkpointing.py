"""Activation checkpointing. (Placeholder until issue #4 lands: refuses modes it cannot do.)"""

from __future__ import annotations

from torch import nn

from smp.config import ConfigError, SMPConfig


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module], config: SMPConfig) -> list[nn.Module]:
    """Wrap blocks for recompute; returns the (possibly wrapped) blocks in the same order."""
    if config.activation_checkpointing.mode != "none":
        raise ConfigError("activation_checkpointing is not available in this build yet; set it to none")
    return blocks
