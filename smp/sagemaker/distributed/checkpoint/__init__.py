"""`torch.sagemaker.distributed.checkpoint`: SMP's save/load entry points on
torch.distributed.checkpoint (DCP). For smp's own checkpoints (atomic commits, exact resume,
resharding checks) see `smp.checkpointing`."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.distributed.checkpoint import (
    async_utils, filesystem, state_dict_loader, state_dict_saver, state_dict_utils,
)

__all__ = ["async_utils", "filesystem", "state_dict_loader", "state_dict_saver", "state_dict_utils"]

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.distributed.checkpoint", "checkpoints",
    "save with state_dict_saver.save / async_save, load with state_dict_loader.load",
)
