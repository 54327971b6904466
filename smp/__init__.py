"""smp: PyTorch-native model parallelism (FSDP2, hybrid sharding, ...) from one config file."""

from smp import checkpointing  # smp.checkpointing.save / load / latest / export_hf / load_hf
from smp.config import SMPConfig, load_config
from smp.errors import CheckpointError, ConfigError, Error, SMPWarning
from smp.reliability import NonFiniteGradientError, PeerFailure, check_finite_grads, step_guard
from smp import runtime
from smp.runtime import is_initialized, shutdown, state
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


def init(config=None, *, backend: str | None = None):
    """Validate the config, join (or create) the process group and build the device mesh
    (smp.runtime.init; reads torchrun's environment). A script that imported accelerate gets
    its Accelerator adapted for the session (docs/accelerate.md)."""
    return runtime.init(config, backend=backend, integrations=_integrations())


def session(config=None, *, backend: str | None = None):
    """`with smp.session(cfg) as st:` = `smp.init(cfg)` ... `smp.shutdown()`, even on error."""
    return runtime.session(config, backend=backend, integrations=_integrations())


def _integrations() -> list:
    """The libraries the script uses that smp adapts for the session: accelerate, when the
    script imported it (smp never imports it itself)."""
    import sys

    if "accelerate" not in sys.modules:
        return []
    from smp.integrations import accelerate

    return [accelerate]


def init_context():
    """Where to build the model: the meta device when `delayed_param_initialization` is on."""
    import contextlib

    import torch

    from smp.runtime import current

    if current().config.delayed_param_initialization:
        return torch.device("meta")
    return contextlib.nullcontext()
