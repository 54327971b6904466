"""Activation memory: checkpointing (full / selective) and offloading to host memory."""

from smp.activations.checkpointing import apply_activation_checkpointing
from smp.activations.offloading import apply_activation_offloading

__all__ = ["apply_activation_checkpointing", "apply_activation_offloading"]
