"""Activation memory: checkpointing (full / selective) and offloading to host memory."""

from smp.activations.checkpointing import apply_activation_checkpointing, is_checkpointed
from smp.activations.offloading import OffloadStats, apply_activation_offloading, offload_stats

__all__ = [
    "OffloadStats",
    "apply_activation_checkpointing",
    "apply_activation_offloading",
    "is_checkpointed",
    "offload_stats",
]
