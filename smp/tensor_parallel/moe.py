"""Mixture-of-experts under tensor parallel: every rank holds a slice of every expert.

transformers' MoE models (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...) keep their experts as 3-D
parameters in one module (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) and
ship the plan `experts: moe_tp_experts` with parameter entries `experts.gate_up_proj:
packed_colwise`, `experts.down_proj: rowwise`. smp reads it the way transformers does:

* each expert's intermediate dim I is split over the TP ranks (gate and up each keep their
  r-th slice, so `chunk(2)` in the experts' forward still yields a matching gate/up pair);
* the experts' forward runs unchanged on the local slices: its output is each rank's partial
  sum over its slice of I, summed once over the TP group (`_SumForward`);
* its inputs (the hidden states and the router's top-k weights) are replicated, but each
  rank's gradient into them covers only its slice: summed in backward (`_SumBackward`). The
  router and any shared expert outside the plan thus see full gradients.

Under sequence parallel the MoE block (the experts' parent, holding the router) gathers the
sequence at its entry and hands a sequence shard back at its exit (styles.WholeSequence).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from smp.errors import PlanError


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: partial outputs -> their total."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) in backward: a replicated input whose gradient each
    rank computes only partly."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def expert_placement(style: str, ndim: int, owner: str) -> Placement:
    """Where a 3-D expert parameter `[experts, out, in]` is split, by its plan style."""
    if ndim != 3:
        raise PlanError(
            f"tensor-parallel plan: {owner} is {ndim}-D; smp splits expert parameters laid out "
            "[experts, out, in] (3-D). Expert biases are not supported: drop the experts' "
            "'moe_tp_experts' entry to keep them replicated, or set tensor_parallel_degree: 1"
        )
    if style == "packed_colwise":  # [gate | up] on the out dim: rank r keeps gate_r and up_r
        return _StridedShard(1, split_factor=2)
    if style == "colwise":
        return Shard(1)
    if style == "rowwise":
        return Shard(2)
    if style == "packed_rowwise":
        return _StridedShard(2, split_factor=2)
    raise PlanError(
        f"tensor-parallel plan: style {style!r} on expert parameter {owner}; expert parameters take "
        "'packed_colwise', 'colwise', 'rowwise' or 'packed_rowwise'"
    )


class MoeExperts(ParallelStyle):
    """`moe_tp_experts`: split each expert's parameters by `param_styles` ({name: style}) and
    run the experts' own forward on the local slices (see the module docstring)."""

    def __init__(self, param_styles: dict[str, str], name: str):
        super().__init__()
        self.param_styles = param_styles
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        params = dict(module.named_parameters(recurse=False))
        missing = sorted(set(params) - set(self.param_styles))
        if missing:
            raise PlanError(
                f"tensor-parallel plan: {self.name!r} is styled 'moe_tp_experts' but its parameters "
                f"{missing} have no entry; add e.g. '{self.name}.{missing[0]}': 'rowwise' (or "
                "'packed_colwise' for a fused gate|up), so that every expert weight is split"
            )
        for pname, p in params.items():
            placement = expert_placement(self.param_styles[pname], p.ndim, f"{self.name}.{pname}")
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(p, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad,
            ))
        group = device_mesh.get_group()
        original_forward = module.forward

        def forward(hidden_states: torch.Tensor, *routing: Any, **kwargs: Any) -> torch.Tensor:
            hidden_states = _SumBackward.apply(_local(hidden_states), group)
            routing = tuple(
                _SumBackward.apply(_local(t), group) if isinstance(t, torch.Tensor) and t.is_floating_point() else _local(t)
                for t in routing
            )
            saved = dict(module._parameters)
            try:
                for pname, p in saved.items():
                    if isinstance(p, DTensor):  # its gradient is exactly this rank's slice: grad placement as the param's
                        module._parameters[pname] = p.to_local()  # type: ignore[assignment]
                out = original_forward(hidden_states, *routing, **kwargs)
            finally:
                module._parameters.update(saved)
            return _SumForward.apply(out, group)

        module.forward = forward  # type: ignore[method-assign]
        return module
