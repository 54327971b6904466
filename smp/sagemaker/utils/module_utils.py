"""`torch.sagemaker.utils.module_utils`: the two helpers custom `init_method_using_config`
functions call (see DelayedParamIniter)."""

from __future__ import annotations

import torch
from torch import nn

from smp._compat import own_buffers
from smp.sagemaker._guide import unsupported_module_getattr


def empty_module_params(module: nn.Module, device: torch.device | str | None = None, recurse: bool = False) -> nn.Module:
    """Give `module`'s parameters (its descendants' too with `recurse`) uninitialised storage
    on `device` (default: the current accelerator, else the host)."""
    if device is None:
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    return module.to_empty(device=device, recurse=recurse)


def move_buffers_to_device(module: nn.Module, device: torch.device | str, recurse: bool = False) -> nn.Module:
    """Move `module`'s buffers (its descendants' too with `recurse`) to `device`, values kept
    (a meta buffer gets uninitialised storage)."""
    modules = module.modules() if recurse else [module]
    for m in modules:
        buffers = own_buffers(m)
        for name, buffer in buffers.items():
            if buffer is not None:
                buffers[name] = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
    return module


__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.utils.module_utils", "names", "use torch.nn.Module.to_empty / .to"
)
