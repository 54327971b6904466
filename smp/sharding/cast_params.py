"""Mixed precision without FSDP, where FSDP would shard over one rank.

Over a one-rank shard group FSDP2 shards nothing and reduces nothing; what it still does is mixed
precision: each unit's parameters are cast to `param_dtype` before its forward, their gradients
are cast to the reduce dtype (float32) after backward and land on the float32 parameters. It does
that through per-unit hooks, per-parameter copies and DTensor wrapping of every gradient: about a
thousand Python calls per unit per step, which on a fast GPU is the step (the host cannot keep up).

`CastParameters` does the same arithmetic with none of that: before the model's forward every
float32 parameter's slot gets `param.to(param_dtype)`, a differentiable cast, so backward's
`ToCopyBackward` hands each parameter its float32 gradient (the bf16 gradient cast up, summed into
`.grad` as FSDP sums its reduced gradients). Each slot gets its float32 parameter back as soon as
that parameter's gradient has landed (so the cast copies free during backward, as FSDP's per-unit
reshard frees them), and every slot at the end of backward, at a forward without gradients, and
before a state dict is read or loaded. Blocks cast their floating inputs (and outputs, with
`output_dtype`) at their boundaries as FSDP's per-block units do, so the result is bitwise the
per-block FSDP run's (tests/sharding/test_host_layout.py).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from smp._compat import apply_to_tensors, at_backward_end, own_parameters, tree_leaves


def _cast(dtype: torch.dtype, x: Any) -> Any:
    """FSDP2's input/output cast: floating tensors of another dtype only."""
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


class CastParameters:
    """The parameters of `model` (except `skip`) cast to `param_dtype` from the start of its
    forward to the end of its backward; `blocks` cast their floating inputs to `param_dtype`
    (`cast_forward_inputs`) and their outputs to `output_dtype`, as FSDP2 units do."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], *, param_dtype: torch.dtype | None,
                 output_dtype: torch.dtype | None, cast_forward_inputs: bool, skip: set[nn.Parameter]) -> None:
        self.param_dtype = param_dtype
        self.output_dtype = output_dtype
        self.cast_inputs = cast_forward_inputs and param_dtype is not None
        skipped = {id(p) for p in skip}
        # (a module's parameter dict, name) of every parameter slot to cast; parameters are read
        # from the slot at each forward, so that a materialisation or load that replaces them is seen.
        self.slots = [(own_parameters(m), n) for m in model.modules() for n, p in own_parameters(m).items()
                      if p is not None and id(p) not in skipped] if param_dtype is not None else []
        self.masters: list[torch.Tensor] | None = None  # the parameters while their casts sit in the slots
        # Per slot, the parameter whose gradient hook hands the slot back (a weak reference).
        self.hooked: list[weakref.ref | None] = [None] * len(self.slots)
        for unit in [model, *blocks]:
            unit.register_forward_pre_hook(self.cast_unit_inputs, with_kwargs=True)
            unit.register_forward_hook(self.cast_unit_output)
        model.register_forward_pre_hook(self.pre_forward)  # after the root's input cast: order as FSDP's
        model.register_forward_hook(self.post_forward)
        model.register_state_dict_pre_hook(lambda *_: self.restore())
        model.register_load_state_dict_pre_hook(lambda *_: self.restore())

    def cast_unit_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.cast_inputs:
            return args, kwargs
        cast = functools.partial(_cast, self.param_dtype)
        return (tuple(_cast_shallow(cast, a) for a in args),
                {k: _cast_shallow(cast, v) for k, v in kwargs.items()})

    def cast_unit_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.output_dtype is None:
            return output
        return apply_to_tensors(functools.partial(_cast, self.output_dtype), output)

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self.restore()  # a forward whose backward never ran
        if not self.slots:
            return
        masters = [params[n] for params, n in self.slots]
        grad, hooked, dtype = torch.is_grad_enabled(), self.hooked, self.param_dtype
        for index, ((params, n), p) in enumerate(zip(self.slots, masters)):
            if grad and p.requires_grad and (hooked[index] is None or hooked[index]() is not p):
                p.register_post_accumulate_grad_hook(functools.partial(self.restore_one, index))
                hooked[index] = weakref.ref(p)
            params[n] = p.to(dtype)
        self.masters = masters

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.masters is None:
            return
        waiting = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not waiting:  # no backward will come (no_grad, eval, frozen model)
            self.restore()
            return
        # Backward (or a checkpointed block's recompute) reads the casts from the slots until it ends.
        torch.autograd.graph.register_multi_grad_hook(waiting, self.on_backward, mode="any")

    def on_backward(self, grad: Any) -> None:
        at_backward_end(self.restore)

    def restore_one(self, index: int, param: torch.Tensor) -> None:
        """Put `param` back in its slot once its gradient has landed: nothing after reads its cast."""
        if self.masters is not None and self.masters[index] is param:
            params, n = self.slots[index]
            params[n] = param

    def restore(self) -> None:
        if self.masters is None:
            return
        for (params, n), p in zip(self.slots, self.masters):
            params[n] = p
        self.masters = None


def _cast_shallow(cast: Any, value: Any) -> Any:
    """`apply_to_tensors(cast, value)` without its walk for the common cases (a block's hidden
    states, masks, positions, RoPE's pair): a tensor is cast here, None and numbers pass, a plain
    tuple is walked here; anything else goes to FSDP's walker."""
    if isinstance(value, torch.Tensor):
        return cast(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value) is tuple:  # RoPE's (cos, sin)
        return tuple(_cast_shallow(cast, v) for v in value)
    return apply_to_tensors(cast, value)
