"""`torch.sagemaker.utils.process_group_utils`: `get_global_ranks`."""

from __future__ import annotations

import torch.distributed as dist

from smp.sagemaker._guide import unsupported_module_getattr


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of `process_group` (None: the default group), in group-rank order."""
    return dist.get_process_group_ranks(process_group or dist.group.WORLD)


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.utils.process_group_utils", "names", "use torch.distributed's group functions"
)
