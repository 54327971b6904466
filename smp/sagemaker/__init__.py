"""smp.sagemaker: SMP v2's `torch.sagemaker` names on smp, for porting SMP v2 scripts.

    import torch.sagemaker as tsm            ->  import smp.sagemaker as tsm
    from torch.sagemaker.X import Y          ->  from smp.sagemaker.X import Y

Each name does what SMP v2's reference says, on smp's machinery (FSDP2, DCP). A name smp does
not implement raises NotSupportedBySmp (a NotImplementedError) naming the section of
docs/migrating-from-smp-v2.md that says what to use instead.
"""

from smp.runtime import is_initialized
from smp.sagemaker._imports import install_missing_module_errors

install_missing_module_errors()  # before the submodules: `smp.sagemaker.X` SMP v2 had, smp not

from smp.sagemaker import checkpoint, delayed_param, distributed, grad_norm, logger, moe, nn, tensor_parallel, utils  # noqa: E402
from smp.sagemaker._guide import MigrationError, NotSupportedBySmp, unsupported_module_getattr
from smp.sagemaker._session import SMPv2DifferenceWarning, init
from smp.sagemaker._state_view import state  # smp's state with SMP v2's names
from smp.sagemaker._transform import transform

__all__ = [
    "MigrationError", "NotSupportedBySmp", "SMPv2DifferenceWarning", "checkpoint", "delayed_param",
    "distributed", "grad_norm", "init", "is_initialized", "logger", "moe", "nn", "state",
    "tensor_parallel", "transform", "utils",
]


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker", "names", "the guide's table lists every SMP v2 name with its smp equivalent"
)
