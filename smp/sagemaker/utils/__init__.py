"""`torch.sagemaker.utils`: the helpers SMP v2 scripts import from it."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.utils import module_utils, process_group_utils, utils
from smp.sagemaker.utils.module_utils import empty_module_params, move_buffers_to_device
from smp.sagemaker.utils.process_group_utils import get_global_ranks
from smp.sagemaker.utils.utils import timeit

__all__ = [
    "empty_module_params", "get_global_ranks", "module_utils", "move_buffers_to_device",
    "process_group_utils", "timeit", "utils",
]

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.utils", "names", "see the guide's table for the smp equivalent"
)
