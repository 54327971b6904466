"""The model's own load-balancing (auxiliary) loss, from the router statistics of the whole
data-parallel batch.

transformers' `load_balancing_loss_func` (Switch Transformer, eq. 4-6) is
num_experts x sum_e f_e x P_e, with f_e the fraction of token choices routed to expert e and
P_e its mean router probability, both over the rows of the batch. It is a product of two batch
means, not a mean over rows: computed on each rank's rows and averaged over ranks it is not the
loss of the global batch (tests/expert_parallel/test_expert_parallel.py::test_aux_loss_is_not_per_row shows the
gap). So under expert parallelism the sums behind f and P (and the row count) are summed over
the data-parallel ranks first; every rank then holds the one-process value, and its gradient
(the probability sums travel through an autograd-aware all-gather) is the one-process
gradient once FSDP averages the ranks' gradients.

The same holds without expert parallelism: plain FSDP (or HSDP) with more than one data-parallel
rank splits the batch the same way, so smp.transform installs the reduction whenever the batch
is split. smp replaces a family's `load_balancing_loss_func` only after checking that it is the
formula above (its signature, and its value on random router logits with and without a mask);
a family whose function is another formula (Doge's product-key experts, Switch Transformers'),
or a batch split over context-parallel ranks, is refused when the loss would be computed.

The replacement is scoped to the transformed model: its forward pre-hook puts smp's function
into the family's modeling module and its forward hook (always called, also on an exception)
puts back what was there. Outside that forward, every other model of the family (a reference
copy, a model of another session) calls transformers' own function, and importing smp or
transforming a model leaves transformers' module as it was.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from smp._compat import all_gather_autograd
from smp.errors import ConfigError

_STANDARD_ARGS = ["gate_logits", "num_experts", "top_k", "attention_mask"]


def _summed(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over `group`, differentiable (all-gather; its backward reduce-scatters the gradient)."""
    return all_gather_autograd(t.unsqueeze(0), gather_dim=0, group=group).sum(0)


def global_load_balancing_loss(
    gate_logits: tuple[torch.Tensor, ...] | None, num_experts: int, top_k: int = 2,
    attention_mask: torch.Tensor | None = None, *, group: dist.ProcessGroup | None = None,
) -> torch.Tensor | int:
    """transformers' `load_balancing_loss_func` with its sums taken over `group` (None: this
    rank only, which is the transformers function). Also for user models: pass the router
    logits of each MoE layer and the data-parallel group."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    device = gate_logits[0].device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total_rows = torch.zeros((), dtype=torch.float32, device=device)
    flat_mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        routing_weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        if flat_mask is None:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.histc(
                selected.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts
            )
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=device
            ).scatter_add_(0, selected.reshape(-1), flat_mask.repeat_interleave(top_k))
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    if group is not None:
        counts = torch.cat([tokens_per_expert_sum, total_rows.reshape(1)]).detach()
        dist.all_reduce(counts, group=group)  # routing counts carry no gradient
        tokens_per_expert_sum, total_rows = counts[:-1], counts[-1]
        router_prob_sum = _summed(router_prob_sum, group)
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def is_standard_loss(function: Callable[..., Any]) -> bool:
    """`function` is transformers' Switch-Transformer load-balancing loss: the signature
    (gate_logits, num_experts, top_k, attention_mask) and the value of
    `global_load_balancing_loss` without a group, on random router logits of 2 layers with and
    without an attention mask (a private generator: the caller's random stream is untouched)."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    if [p.name for p in params[:4]] != _STANDARD_ARGS or any(p.default is p.empty for p in params[4:]):
        return False
    gen = torch.Generator().manual_seed(0)
    batch, seq, experts, top_k = 2, 5, 4, 2
    # On the CPU by name: `smp plan` transforms under a meta device context.
    logits = tuple(torch.randn(batch * seq, experts, generator=gen, device="cpu") for _ in range(2))
    mask = torch.ones(batch, seq, dtype=torch.long, device="cpu")
    mask[0, :2] = 0
    for m in (None, mask):
        try:
            theirs = function(logits, experts, top_k, m)
        except Exception:
            return False
        ours = global_load_balancing_loss(logits, experts, top_k, m)
        if not isinstance(theirs, torch.Tensor) or not torch.allclose(theirs.float(), ours, rtol=1e-5, atol=1e-6):
            return False
    return True


class _ReducedDuringForward:
    """Forward hooks that make `modeling.load_balancing_loss_func` smp's reduction over `group`
    (or, when `group` is a message, a function that raises it) while the model's forward runs,
    and put back what was there afterwards (nested forwards restore in order)."""

    def __init__(self, modeling: Any, group: dist.ProcessGroup | str) -> None:
        self.modeling, self.group = modeling, group
        self.saved: list[Callable[..., Any]] = []

    def load_balancing_loss_func(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.group, str):
            raise ConfigError(self.group)
        return global_load_balancing_loss(*args, **kwargs, group=self.group)

    def enter(self, module: nn.Module, args: Any) -> None:
        self.saved.append(self.modeling.load_balancing_loss_func)
        self.modeling.load_balancing_loss_func = self.load_balancing_loss_func

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.saved:
            self.modeling.load_balancing_loss_func = self.saved.pop()


def apply_load_balancing(
    model: nn.Module, token_group: dist.ProcessGroup | None, mode: str | None = None,
    aux_loss_coeff: float | None = None, *, unsupported: str | None = None,
) -> None:
    """Make `model`'s own load-balancing loss global over `token_group`, the ranks that hold
    different rows of the batch (None: one rank holds the whole batch; only the switches apply).
    `mode` ("aux_loss", "none"; None keeps the model's setting) and `aux_loss_coeff` (None keeps
    the model's) set the transformers switches `output_router_logits` and `router_aux_loss_coef`.
    `unsupported`: why the batch's router statistics cannot be gathered (e.g. context parallel);
    then, as for a family whose loss is not the standard formula, a model computing the loss is
    refused: ConfigError now when its config turns the loss on, else when a forward computes it."""
    hf_config = getattr(model, "config", None)
    has_aux = hasattr(hf_config, "output_router_logits") and hasattr(model, "router_aux_loss_coef")
    if (mode is not None or aux_loss_coeff is not None) and not has_aux:
        raise ConfigError(
            f"moe.moe_load_balancing / moe.moe_aux_loss_coeff set, but {type(model).__name__} has no "
            "transformers load-balancing loss (config.output_router_logits, router_aux_loss_coef) for "
            "smp to switch; compute it in your loss, e.g. with "
            "smp.expert_parallel.global_load_balancing_loss(router_logits, num_experts, top_k, group=...)"
        )
    if mode is not None:
        hf_config.output_router_logits = mode == "aux_loss"
    if aux_loss_coeff is not None:
        model.router_aux_loss_coef = hf_config.router_aux_loss_coef = aux_loss_coeff
    if token_group is None and unsupported is None:
        return  # the whole batch on every rank: the model's own loss is the one-process loss
    modeling = sys.modules.get(type(model).__module__)
    original = getattr(modeling, "load_balancing_loss_func", None)
    if original is None:
        return  # no transformers load-balancing loss in this model's module (a user model: its own)
    name = type(model).__name__
    if unsupported is None and not is_standard_loss(original):
        unsupported = (
            f"{name}'s load-balancing loss ({modeling.__name__}.load_balancing_loss_func) is not the "
            "Switch-Transformer formula smp knows how to sum over the data-parallel ranks, and the loss "
            "of the whole batch is not the mean of the ranks' losses"
        )
    if unsupported is not None:
        unsupported = (
            f"{unsupported}: smp cannot give {name} the one-process load-balancing loss. Turn it off "
            "(moe: {moe_load_balancing: none}, i.e. config.output_router_logits=False) and, if you need "
            "one, add to your loss a balancing loss whose router statistics are summed over every rank "
            "that holds other tokens of the batch (smp.expert_parallel.global_load_balancing_loss("
            "router_logits, num_experts, top_k, group=...) is the Switch-Transformer one)"
        )
        if getattr(hf_config, "output_router_logits", False):
            raise ConfigError(unsupported)
    hooks = _ReducedDuringForward(modeling, unsupported if unsupported is not None else token_group)
    model.register_forward_pre_hook(hooks.enter)
    model.register_forward_hook(hooks.exit, always_call=True)
    model._smp_load_balancing = hooks.group  # read by summed_over (smp.step's check)


def summed_over(model: nn.Module) -> dist.ProcessGroup | str | None:
    """What `apply_load_balancing` made of `model`'s load-balancing loss: the process group its
    router statistics are summed over, the message saying why they cannot be (a str), or None
    when it installed nothing (one rank holds the whole batch, or the model's module has no
    transformers load-balancing loss)."""
    return getattr(model, "_smp_load_balancing", None)
