"""BatchNorm in eval mode under data parallelism: its backward gets the output gradient in the
input's layout (smp/sharding/batch_norm.py), which torch's CPU kernel needs to be right."""

from __future__ import annotations

import torch
from torch import nn

from smp.sharding.batch_norm import _grad_in_input_layout


def _case() -> tuple[nn.BatchNorm2d, torch.Tensor, torch.Tensor]:
    """CvT's value projection with one row: the input contiguous (NCHW), the output gradient a
    channels-last slice past the class token (strides (C, 1, 2C, C), offset C)."""
    torch.manual_seed(0)
    channels = 384
    bn = nn.BatchNorm2d(channels).double().eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
    x = torch.randn(1, channels, 2, 2, dtype=torch.float64)
    tokens = torch.randn(1, 5, channels, dtype=torch.float64)  # class token + 2 x 2 positions
    grad = tokens[:, 1:].permute(0, 2, 1).view(1, channels, 2, 2)
    return bn, x, grad


def _input_grad(bn: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    bn(x).backward(grad)
    return x.grad


def _analytic(bn: nn.BatchNorm2d, grad: torch.Tensor) -> torch.Tensor:
    return grad * (bn.weight / torch.sqrt(bn.running_var + bn.eps)).view(1, -1, 1, 1)


def test_eval_batch_norm_gradient_in_input_layout_is_exact():
    bn, x, grad = _case()
    bn.register_forward_hook(_grad_in_input_layout)
    assert torch.allclose(_input_grad(bn, x, grad), _analytic(bn, grad), rtol=0, atol=1e-12)


def test_negative_control_torch_kernel_with_mixed_layouts():
    """Without the hook torch's kernel is off (when a torch release fixes it, this fails: the
    hook can then go)."""
    bn, x, grad = _case()
    assert (_input_grad(bn, x, grad) - _analytic(bn, grad)).abs().max() > 1e-4
