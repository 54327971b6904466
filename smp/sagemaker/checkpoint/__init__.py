"""`torch.sagemaker.checkpoint`: SMP v2's checkpoint folder helpers (`utils`)."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.checkpoint import utils

__all__ = ["utils"]

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.checkpoint", "checkpoints", "smp implements torch.sagemaker.checkpoint.utils only",
)
