"""Delayed (meta-device) initialisation: materialise a sharded model one module at a time.

A model built under `torch.device("meta")` holds no memory. After `fully_shard` its parameters
are meta DTensors; `materialize_meta_model` allocates only each rank's shards and fills them so
that they equal the eager init for the same seed:

- eager construction draws the RNG in each module's `reset_parameters()` and, for transformers
  models, in `initialize_weights()` at the end of each PreTrainedModel's __init__; `_Replay`
  re-runs those calls in construction order, on full-size temporary tensors of one module at a
  time (peak extra memory: about one FSDP unit's parameters), keeping this rank's shard.

Every rank computes the same full values (same seed), so no rank sends data to another in the
first pass; the second gathers one module at a time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _swap_entries(module: nn.Module, recurse: bool) -> list[tuple[nn.Module, str, DTensor]]:
    """(owner module, name, sharded param) for `module`'s parameters; with `recurse`, also its
    descendants' down to (not into) other FSDP units, so one swap never spans two units."""
    entries = []
    stack = [module]
    while stack:
        current = stack.pop()
        for name, param in current._parameters.items():
            if isinstance(param, DTensor):
                entries.append((current, name, param))
        if recurse:
            stack.extend(c for c in current.children() if not isinstance(c, FSDPModule))
    return entries


@contextmanager
def _full_parameters(
    module: nn.Module, gather: bool, first_owner: dict[int, int], recurse: bool = False
) -> Iterator[None]:
    """Swap sharded parameters for plain full tensors during an init call, then keep the shards.

    Each (module, name) gets its own temporary: eager construction ties weights only after
    initialising them, so a tied copy (an LM head tied to the embedding) draws the RNG into
    its own tensor and only the first owner's values are kept.
    """
    entries = _swap_entries(module, recurse)
    for owner, name, param in entries:
        if gather:
            full = param.full_tensor()
            if full.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr():
                full = full.clone()  # an unsharded mesh returns the shard itself: never alias it
        else:
            full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        owner._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for owner, name, param in entries:
            full = owner._parameters[name].detach()
            owner._parameters[name] = param
            if first_owner.get(id(param)) != id(owner):
                continue
            # src_data_rank=None: every rank slices its own shard from identical local data.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            with torch.no_grad():
                param.to_local().copy_(local.to_local())


def _is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def _init_conv1d(module: nn.Module) -> None:
    nn.init.normal_(module.weight, std=0.02)  # transformers.pytorch_utils.Conv1D.__init__


# Known classes that draw the RNG in __init__ rather than in a reset_parameters() (GPT-2's
# Conv1D): the replay must draw exactly as they do, or every later module gets other values.
_CONSTRUCTOR_INITS: dict[str, Callable[[nn.Module], None]] = {"Conv1D": _init_conv1d}


class _Replay:
    """Re-runs the RNG draws of eager construction, in construction order.

    A module's children are built (and draw) before the module's own `reset_parameters()` runs
    at the end of its __init__; a transformers PreTrainedModel ends its __init__ by running
    `initialize_weights()` over its subtree (post-order, skipping modules a nested
    PreTrainedModel already initialised). Verified bitwise against eager construction.
    """

    def __init__(self, model: nn.Module) -> None:
        self.hf_done: set[int] = set()
        # Each parameter belongs to the first module that registers it; a tied copy elsewhere
        # (an LM head tied to the embedding) draws the RNG but does not write.
        self.first_owner: dict[int, int] = {}
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None:
                    self.first_owner.setdefault(id(param), id(module))

    def construct(self, module: nn.Module) -> None:
        for child in module.children():
            self.construct(child)
        reset = getattr(module, "reset_parameters", None)
        constructor_init = _CONSTRUCTOR_INITS.get(type(module).__name__)
        if callable(reset) or constructor_init is not None:
            with _full_parameters(module, gather=False, first_owner=self.first_owner):
                reset() if callable(reset) else constructor_init(module)
        if _is_hf_model(module):
            self._hf_initialize(module)

    def _hf_initialize(self, model: nn.Module) -> None:
        from transformers import initialization as hf_init

        is_custom = model.is_custom_code()

        def visit(module: nn.Module, init_fn: Callable) -> None:
            for child in module.children():
                visit(child, child._initialize_weights if _is_hf_model(child) else init_fn)
            if id(module) not in self.hf_done:
                # recurse: an init may write a child's weight (GPT-2 scales attn.c_proj).
                with _full_parameters(module, gather=True, first_owner=self.first_owner, recurse=True):
                    init_fn(module, is_custom)
                self.hf_done.add(id(module))

        with hf_init.guard_torch_init_functions():
            visit(model, model._initialize_weights)


def _check_initialisable(model: nn.Module) -> None:
    """Outside transformers, only `reset_parameters()` can re-create a module's values."""
    for name, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False)]
        own += [n for n, b in module.named_buffers(recurse=False)]
        if own and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"delayed initialisation cannot initialise module '{name or '<root>'}' "
                f"({type(module).__name__}): it holds {own} but has no reset_parameters(). "
                "Give the class a reset_parameters() that fills them, or build the model eagerly."
            )


@torch.no_grad()
def materialize_meta_model(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a (sharded) meta model on `device` and initialise it like eager construction."""
    hf_model = _is_hf_model(model)
    if not hf_model:
        _check_initialisable(model)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    _Replay(model).construct(model)
    if hf_model:
        model.tie_weights()
