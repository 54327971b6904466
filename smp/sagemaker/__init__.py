"""smp.sagemaker: SMP v2's `torch.sagemaker` names on smp, for porting SMP v2 scripts.

    import torch.sagemaker as tsm            ->  import smp.sagemaker as tsm
    from torch.sagemaker.X import Y          ->  from smp.sagemaker.X import Y

Each name does what SMP v2's reference says, on smp's machinery (FSDP2, DCP). A name smp does
not implement raises NotSupportedBySmp (a NotImplementedError) naming the section of
docs/migrating-from-smp-v2.md that says what to use instead.
"""

from smp.runtime import is_initialized, state
from smp.sagemaker import delayed_param, distributed, grad_norm, logger, moe, nn, utils
from smp.sagemaker._guide import MigrationError, NotSupportedBySmp, unsupported_module_getattr
from smp.sagemaker._session import SMPv2DifferenceWarning, init
from smp.sagemaker._transform import transform

__all__ = [
    "MigrationError", "NotSupportedBySmp", "SMPv2DifferenceWarning", "delayed_param", "distributed",
    "grad_norm", "init", "is_initialized", "logger", "moe", "nn", "state", "transform", "utils",
]


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker", "names", "the guide's table lists every SMP v2 name with its smp equivalent"
)
