"""`torch.sagemaker.distributed`: only its `checkpoint` package has an smp counterpart."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.distributed import checkpoint

__all__ = ["checkpoint"]

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.distributed", "checkpoints", "use torch.distributed directly"
)
