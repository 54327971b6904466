"""Shape-only stand-ins for ops whose meta kernels are narrower than their real ones, so that
a forward on the meta device (`smp plan`'s activation count, context parallel's attention
probe) runs where the real one would."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class _GroupedMM(torch.autograd.Function):
    """Stands in for torch.nn.functional.grouped_mm on the meta device: transformers' MoE experts
    (`grouped_mm` implementation, their default) run one grouped matmul over the token choices
    sorted by expert. torch's meta kernel accepts only bf16; this one takes any dtype and saves
    what the real op saves for backward, its two operands. The row count, tokens x top_k, does
    not depend on the routing, so no routing values are needed on meta."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                out_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype or a.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None, None


@contextlib.contextmanager
def shape_only_grouped_mm() -> Iterator[None]:
    """`torch.nn.functional.grouped_mm` replaced by `_GroupedMM` (2-D tokens x 3-D experts
    without bias) while the block runs; other calls go to torch's."""
    import torch.nn.functional as F

    original = getattr(F, "grouped_mm", None)
    if original is None:  # a torch without it: transformers takes its own fallback op
        yield
        return

    def grouped_mm(a, b, *args: Any, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        if bias is not None or args or kwargs or a.dim() != 2 or b.dim() != 3:
            return original(a, b, *args, offs=offs, bias=bias, out_dtype=out_dtype, **kwargs)
        return _GroupedMM.apply(a, b, offs, out_dtype)

    F.grouped_mm = grouped_mm
    try:
        yield
    finally:
        F.grouped_mm = original
