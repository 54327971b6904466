"""smp: PyTorch-native model parallelism (FSDP2, hybrid sharding, ...) from one config file."""

from smp import checkpointing  # smp.checkpointing.save / load / latest / export_hf / load_hf
from smp.config import SMPConfig, load_config
from smp.errors import CheckpointError, ConfigError, Error, SMPWarning
from smp.reliability import NonFiniteGradientError, PeerFailure, check_finite_grads, step_guard
from smp.runtime import init, is_initialized, session, shutdown, state
from smp.sharding.gradient_sync import gradient_sync_bytes  # bytes sent per rank (smp_collectives)
from smp.training import clip_grad_norm_, evaluate, no_sync, step  # step: one training step, any layout
from smp.transform import transform

from smp._version import __version__

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Error",
    "NonFiniteGradientError",
    "PeerFailure",
    "SMPConfig",
    "SMPWarning",
    "check_finite_grads",
    "checkpointing",
    "clip_grad_norm_",
    "evaluate",
    "gradient_sync_bytes",
    "init",
    "init_context",
    "is_initialized",
    "load_config",
    "no_sync",
    "session",
    "shutdown",
    "state",
    "step",
    "step_guard",
    "transform",
]


def init_context():
    """Where to build the model: the meta device when `delayed_param_initialization` is on."""
    import contextlib

    import torch

    from smp.runtime import current

    if current().config.delayed_param_initialization:
        return torch.device("meta")
    return contextlib.nullcontext()
