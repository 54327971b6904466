"""Batch statistics under data parallelism: refused in training mode.

BatchNorm in training mode normalises with the mean and variance of the rows it sees and
updates its running averages from them. With the batch split over data-parallel ranks each rank
sees only its own rows, so the outputs, the gradients and the running statistics all differ
from one process on the global batch (a tiny ResNet at world 2: loss 1.5e-2 off), silently.
torch's SyncBatchNorm computes the statistics over every rank's rows, on accelerators only.

smp refuses the forward of such a layer in training mode: a pre-forward hook raises on every
rank at the same layer (the module tree and its mode are the same everywhere), before it runs,
naming it and the fixes. A layer in eval mode (frozen statistics, as a pretrained backbone is
often fine-tuned) normalises with its running averages, as in one process, and runs (one
without running averages, `track_running_stats=False`, uses the batch's statistics in eval
mode too, and is refused there as well).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from smp.anatomy import BATCH_NORMS
from smp.errors import ConfigError



def refuse_batch_statistics(model: nn.Module, dp_size: int) -> list[str]:
    """Hook every BatchNorm layer of `model` to refuse a training-mode forward when the batch
    is split over `dp_size` > 1 ranks; returns the hooked layers' names."""
    if dp_size <= 1:
        return []
    names = []
    for name, module in model.named_modules():
        if isinstance(module, BATCH_NORMS):
            module.register_forward_pre_hook(partial(_refuse, name or "<root>", dp_size))
            module.register_forward_hook(_grad_in_input_layout)
            names.append(name)
    return names


def _refuse(name: str, dp_size: int, module: nn.Module, args: tuple) -> None:
    if module.training or module.running_mean is None:  # normalises with this batch's statistics
        raise ConfigError(
            f"'{name}' ({type(module).__name__}) normalises with the batch statistics of this rank's rows in "
            f"training mode: with the batch split over {dp_size} data-parallel ranks its outputs, gradients and "
            "running statistics differ from one process on the global batch. Freeze its statistics (call .eval() "
            "on the BatchNorm layers after model.train()), replace it with GroupNorm / LayerNorm, or on GPUs "
            "convert it with torch.nn.SyncBatchNorm.convert_sync_batchnorm before smp.transform.")


def _grad_in_input_layout(module: nn.Module, args: tuple, out: Any) -> None:
    """Hand the layer's backward its output gradient laid out like its input.

    torch 2.13's CPU batch-norm backward in eval mode computes a wrong input gradient when the
    input is contiguous (NCHW) and the output gradient is strided like channels-last (both shapes
    equal): CvT's value projection with one row per rank, whose gradient comes back through a
    slice past the class token, is 4e-3 off the analytic gradient (weight / sqrt(running_var +
    eps) times the output gradient), and the one-process run with 4 rows, both tensors
    channels-last, is right. Each rank's rows differ in number from one process's, so layouts
    differ; copying the gradient into the input's layout makes the kernel agree with both."""
    x = args[0] if args else None
    if not isinstance(out, torch.Tensor) or not out.requires_grad or not isinstance(x, torch.Tensor):
        return
    # empty_like keeps the input's strides where they are dense, else it is contiguous
    shape, strides = x.shape, torch.empty_like(x, device="meta").stride()

    def relayout(grad: torch.Tensor) -> torch.Tensor:
        if grad.shape != shape or grad.stride() == strides:
            return grad
        return torch.empty_strided(grad.shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)

    out.register_hook(relayout)
