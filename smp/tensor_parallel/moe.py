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

Layouts follow the flags transformers' experts carry: `is_transposed` (GPT-OSS stores
`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`: [experts, in, out]) and `is_concatenated`
(False: gate and up interleaved `[g0, u0, g1, u1, ...]`, so a plain contiguous split keeps the
pairs). Expert biases `[E, out]` (GPT-OSS's `gate_up_proj_bias`, `down_proj_bias`) take their
weight's style unless the plan names them: a column-wise bias is split like its weight's output
dim; a row-wise bias is whole on every rank and added on TP rank 0 only, so that the summed
partial outputs hold it once (its gradient, whole on rank 0 and zero elsewhere, is Partial).

Under sequence parallel the MoE block (the experts' parent, holding the router) gathers the
sequence at its entry and hands a sequence shard back at its exit (styles.WholeSequence).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from smp._compat import own_parameters, strided_shard
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


def expert_placement(style: str, ndim: int, owner: str, *, transposed: bool = False,
                     interleaved: bool = False) -> Placement:
    """Where an expert parameter is split, by its plan style: a 3-D weight laid out
    `[experts, out, in]` (`[experts, in, out]` when `transposed`), a 2-D bias `[experts, out]`.
    `interleaved`: a packed gate|up output stored `[g0, u0, g1, u1, ...]` (a contiguous slice
    keeps each pair); otherwise `[gate | up]` (rank r keeps gate_r and up_r)."""
    if ndim not in (2, 3):
        raise PlanError(
            f"tensor-parallel plan: {owner} is {ndim}-D; smp splits expert weights laid out "
            "[experts, out, in] or [experts, in, out] (3-D) and expert biases [experts, out] (2-D). "
            "Drop the experts' 'moe_tp_experts' entry to keep them replicated, or set "
            "tensor_parallel_degree: 1"
        )
    out_dim, in_dim = (ndim - 1, ndim - 2) if transposed or ndim == 2 else (1, 2)
    if style in ("rowwise", "packed_rowwise") and ndim == 2:
        return Replicate()  # a row-wise bias acts on the summed output: added once (MoeExperts)
    if style == "colwise" or (style == "packed_colwise" and interleaved):
        return Shard(out_dim)
    if style == "packed_colwise":
        return strided_shard(out_dim, 2)
    if style == "rowwise" or (style == "packed_rowwise" and interleaved):
        return Shard(in_dim)
    if style == "packed_rowwise":
        return strided_shard(in_dim, 2)
    raise PlanError(
        f"tensor-parallel plan: style {style!r} on expert parameter {owner}; expert parameters take "
        "'packed_colwise', 'colwise', 'rowwise' or 'packed_rowwise'"
    )


def _style_of(param_styles: dict[str, str], pname: str, ndim: int) -> str | None:
    """A parameter's own entry; a bias (`<weight>_bias`, 2-D) without one follows its weight."""
    own = param_styles.get(pname)
    weight = param_styles.get(pname.removesuffix("_bias")) if ndim == 2 and pname.endswith("_bias") else None
    if own and weight and (own.endswith("colwise") != weight.endswith("colwise")):
        raise PlanError(
            f"tensor-parallel plan: expert bias {pname} is {own!r} but its weight "
            f"{pname.removesuffix('_bias')} is {weight!r}; a bias is split like its weight's output, "
            "so give it the weight's style (or drop its entry: it then follows the weight)"
        )
    return own or weight


# Each rank runs its slice of every expert, so the split is always the intermediate dim: the
# output of the fused gate|up (or of a separate gate / up), the input of down.
_ROW_ROLE, _COL_ROLE = ("down_proj",), ("gate_up_proj", "gate_proj", "up_proj")
_SWAP = {"colwise": "rowwise", "rowwise": "colwise", "packed_colwise": "packed_rowwise", "packed_rowwise": "packed_colwise"}


def _by_role(pname: str, style: str) -> str:
    """The style of an expert parameter stored [experts, in, out], read by its role.

    transformers names expert styles by tensor dim (colwise: dim -2, rowwise: dim -1) whatever
    the layout, so its shipped plans for [experts, in, out] experts say gate_up_proj
    'packed_rowwise' and down_proj 'colwise' (Aria); a plan written by role says 'packed_colwise'
    and 'rowwise' (GPT-OSS's). Both mean the intermediate dim: a style that would split another
    dim is transformers' name for that one."""
    role = pname.removesuffix("_bias")
    is_row = style in ("rowwise", "packed_rowwise")
    if (role in _ROW_ROLE and not is_row) or (role in _COL_ROLE and is_row):
        return _SWAP.get(style, style)
    return style


def _added_once(bias: DTensor, first: bool) -> torch.Tensor:
    """A row-wise expert bias as this rank's experts add it. Their forward adds it to every
    rank's partial output, and the partial outputs are then summed: only TP rank 0 keeps it.
    `* 0` rather than zeros keeps the graph, so every rank has a gradient (whole on rank 0,
    zero elsewhere: Partial, summed by DTensor)."""
    local = bias.to_local(grad_placements=[Partial()])
    return local if first else local * 0


class MoeExperts(ParallelStyle):
    """`moe_tp_experts`: split each expert's parameters by `param_styles` ({name: style}) and
    run the experts' own forward on the local slices (see the module docstring)."""

    def __init__(self, param_styles: dict[str, str], name: str):
        super().__init__()
        self.param_styles = param_styles
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        params = dict(module.named_parameters(recurse=False))
        styles = {pname: _style_of(self.param_styles, pname, p.ndim) for pname, p in params.items()}
        missing = sorted(pname for pname, style in styles.items() if style is None)
        if missing:
            raise PlanError(
                f"tensor-parallel plan: {self.name!r} is styled 'moe_tp_experts' but its parameters "
                f"{missing} have no entry; add e.g. '{self.name}.{missing[0]}': 'rowwise' (or "
                "'packed_colwise' for a fused gate|up), so that every expert weight is split"
            )
        transposed = bool(getattr(module, "is_transposed", False))
        interleaved = getattr(module, "is_concatenated", True) is False
        if transposed:
            styles = {pname: _by_role(pname, style) for pname, style in styles.items()}
        if styles.get("gate_up_proj") == "colwise" and not interleaved:
            # Some shipped plans (Inkling2's) say 'colwise' here: a contiguous split would give
            # rank 0 only gate rows and rank 1 only up rows, and train silently wrong.
            pattern = re.sub(r"[.]\d+[.]", ".*.", self.name)  # every layer's experts
            raise PlanError(
                f"tensor-parallel plan: '{pattern}.gate_up_proj': 'colwise' would split a fused "
                "[gate | up] contiguously (one rank all gates, the other all ups); pass a tp_plan with "
                f"'{pattern}.gate_up_proj': 'packed_colwise' (each rank keeps its slice of both)"
            )
        added_once = set()  # row-wise biases: whole on every rank, added on TP rank 0 only
        for pname, p in params.items():
            placement = expert_placement(styles[pname], p.ndim, f"{self.name}.{pname}",
                                         transposed=transposed, interleaved=interleaved)
            if isinstance(placement, Replicate):
                added_once.add(pname)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(p, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad,
            ))
        group = device_mesh.get_group()
        first = device_mesh.get_local_rank() == 0
        original_forward = module.forward

        def local_param(pname: str, p: DTensor) -> torch.Tensor:
            if pname in added_once:
                return _added_once(p, first)
            return p.to_local()  # its gradient is exactly this rank's slice: placement as the param's

        def forward(hidden_states: torch.Tensor, *routing: Any, **kwargs: Any) -> torch.Tensor:
            hidden_states = _SumBackward.apply(_local(hidden_states), group)
            routing = tuple(
                _SumBackward.apply(_local(t), group) if isinstance(t, torch.Tensor) and t.is_floating_point() else _local(t)
                for t in routing
            )
            slots = own_parameters(module)
            saved = dict(slots)
            try:
                for pname, p in saved.items():
                    if isinstance(p, DTensor):
                        slots[pname] = local_param(pname, p)  # type: ignore[assignment]
                out = original_forward(hidden_states, *routing, **kwargs)
            finally:
                slots.update(saved)
            return _SumForward.apply(out, group)

        module.forward = forward  # type: ignore[method-assign]
        return module
