"""0-d parameters (CLIP's `logit_scale`): kept whole on every rank, their gradient averaged.

`fully_shard` refuses 0-d parameters, and changing their shape would change the model's
checkpoint (so `export_hf` would no longer load in `from_pretrained`). smp leaves them out of
FSDP (`ignored_params`): each rank holds the whole value, and right after backward accumulates
its gradient, the gradient is averaged over the data-parallel ranks, as FSDP averages every
other gradient. Every rank then applies the same optimizer step to the same value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def scalar_parameters(model: nn.Module) -> set[nn.Parameter]:
    """0-d parameters, and empty ones (DINOv3's `register_tokens` of shape (1, 0, d) at its
    default of no registers), which FSDP2's gradient reduce-scatter cannot take
    (`_chunk_cat expects non-empty tensor`): both kept whole on every rank."""
    return {p for p in model.parameters() if p.dim() == 0 or p.numel() == 0}


def average_scalar_gradients(params: set[nn.Parameter], mesh: DeviceMesh) -> None:
    """Average each parameter's gradient over every dimension of `mesh` after it accumulates."""
    groups = [mesh.get_group(i) for i in range(mesh.ndim)] if mesh.size() > 1 else []

    def average(param: torch.Tensor) -> None:
        for group in groups:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=group)

    for param in params:
        if param.requires_grad and groups:
            param.register_post_accumulate_grad_hook(average)
