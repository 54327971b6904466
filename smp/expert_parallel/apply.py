"""apply_expert_parallel: split each experts module's experts over the "ep" ranks and route its
tokens there; shard_experts: make each experts module its own FSDP unit over the ranks left.

Order in smp.transform: after tensor parallel, before activation checkpointing and FSDP (an
experts module must be an FSDP unit before the block holding it is, so that the block's unit
leaves its parameters alone), as torchtitan does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from smp._compat import add_parameter_slot, own_parameters
from smp.expert_parallel.dispatch import DispatchStats, dispatch
from smp.expert_parallel.plan import EPPlan, ExpertsModule, expand_ep_plan
from smp.sharding.fsdp import offload_policy


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, plan: EPPlan, capacity_factor: float | None = None
) -> list[ExpertsModule]:
    """Split the [num_experts, ...] parameters of every experts module `plan` names on dim 0
    over `ep_mesh` (DTensors, Shard(0): a checkpoint reshards them to any other degree) and
    make its forward dispatch tokens by all-to-all. Returns the experts modules.

    Raises ConfigError (no MoE layer, experts not divisible by the degree) before any collective."""
    degree = ep_mesh.size()
    experts = expand_ep_plan(model, plan, degree)
    rank = ep_mesh.get_local_rank()
    for spec in experts:
        per_rank = spec.num_experts // degree
        for name in spec.param_names:
            full = own_parameters(spec.module)[name]
            local = full.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
            add_parameter_slot(spec.module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        # An instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it.
        spec.module.__dict__["forward"] = ExpertParallelForward(
            spec.module, spec.param_names, spec.num_experts, ep_mesh, capacity_factor
        )
    return experts


def shard_experts(
    experts: list[ExpertsModule], mesh: DeviceMesh, *,
    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None, cast_forward_inputs: bool = True,
    reshard_after_forward: bool | int = True, cpu_offload: bool = False,
) -> None:
    """One FSDP unit per experts module over `mesh` (the data-parallel ranks left after ep).

    Expert parameters shard on dim 1 (dim 0 is already split over ep, and may hold fewer
    experts than `mesh` has ranks). FSDP averages their gradients over `mesh`; the other 1/ep
    is applied in the forward (`_ScaleGradient`). The dtypes, `reshard_after_forward` and
    `cpu_offload` are those of smp.sharding.apply_fsdp."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype,
        cast_forward_inputs=cast_forward_inputs,
    )
    for spec in experts:
        fully_shard(
            spec.module, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy(cpu_offload),
            reshard_after_forward=reshard_after_forward, shard_placement_fn=lambda _param: Shard(1),
        )


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`.

    An expert's gradient sums the contributions of every rank of its ep group (each from a loss
    averaged over that rank's rows), and FSDP then averages over the data-parallel ranks left
    (dp / ep): 1/ep more makes it the gradient of the global mean loss, as for the other
    parameters. (FSDP's own set_gradient_divide_factor needs PREMUL_SUM, which gloo lacks.)"""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@contextlib.contextmanager
def _local_experts(module: nn.Module, names: tuple[str, ...], per_rank: int, grad_scale: float) -> Iterator[None]:
    """The module's experts parameters replaced by this rank's slice (plain tensors, still in
    the autograd graph, gradient scaled by `grad_scale`), and its `num_experts` by the slice's
    count, for one forward."""
    slots = own_parameters(module)
    saved = {name: slots[name] for name in names}
    had_count = "num_experts" in module.__dict__
    count = module.__dict__.get("num_experts")
    try:
        for name, param in saved.items():
            local = param.to_local() if isinstance(param, DTensor) else param
            slots[name] = _ScaleGradient.apply(local, grad_scale)
        if had_count:
            module.__dict__["num_experts"] = per_rank
        yield
    finally:
        slots.update(saved)
        if had_count:
            module.__dict__["num_experts"] = count


class ExpertParallelForward:
    """`experts.forward` under expert parallelism. A class, not a closure, so that
    `copy.deepcopy(model)` gives the copy its own (bound to the copy)."""

    def __init__(self, module: nn.Module, names: tuple[str, ...], num_experts: int, ep_mesh: DeviceMesh,
                 capacity_factor: float | None) -> None:
        self.module = module
        self.names = names
        self.num_experts = num_experts
        self.ep_mesh = ep_mesh
        self.capacity_factor = capacity_factor
        self.stats: DispatchStats | None = None  # the last forward's routing on this rank

    def _local_forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ep = self.ep_mesh.size()
        with _local_experts(self.module, self.names, self.num_experts // ep, 1.0 / ep):
            return type(self.module).forward(self.module, hidden, index, weights)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out, self.stats = dispatch(
            hidden_states, top_k_index, top_k_weights, self._local_forward, self.num_experts,
            self.ep_mesh.get_group(), self.capacity_factor,
        )
        return out


def expert_load(model: nn.Module) -> dict[str, DispatchStats]:
    """Per experts module (by name): the token choices each local expert received and the choices
    dropped by the capacity in this rank's last forward. Empty before the first forward."""
    return {
        name: forward.stats
        for name, module in model.named_modules()
        if isinstance(forward := module.__dict__.get("forward"), ExpertParallelForward) and forward.stats is not None
    }


def is_expert_parallel(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), ExpertParallelForward)

