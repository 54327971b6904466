"""`smp.check_finite_grads`: find NaN/inf gradients after backward, agree across ranks, act.

Each rank sees only its shard of each gradient (FSDP) or its slice (TP), so a NaN can be on
one rank only. The check builds one flag per parameter (nan, inf) from the local shards and
max-reduces the flags over the whole world: every rank then holds the same list of bad
parameters and takes the same decision, so no rank steps the optimizer while another skips
(which would desynchronise the replicas, or hang the next collective).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from smp._compat import tree_leaves
from smp.errors import Error, SMPWarning

logger = logging.getLogger("smp.reliability")

Action = Literal["raise", "skip", "warn"]
_ACTIONS = ("raise", "skip", "warn")
# How many parameter names the message lists; the count is always given.
MAX_NAMED = 5


class NonFiniteGradientError(Error, FloatingPointError):
    """Gradients hold NaN or inf. `.step`, `.parameters` (names) and `.modules` say where."""

    def __init__(self, message: str, step: int | None, parameters: list[str], modules: list[str]):
        super().__init__(message)
        self.step = step
        self.parameters = parameters
        self.modules = modules


class NonFiniteGradientWarning(SMPWarning):
    pass


@torch.no_grad()
def find_nonfinite_grads(model: nn.Module, group: dist.ProcessGroup | None = None) -> list[tuple[str, str]]:
    """[(parameter name, "nan" | "inf" | "nan+inf")] over every rank, in registration order.

    A collective over `group` (default: the world): every rank must call it.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = _device_of(named, group)
    flags = torch.zeros(2, max(len(named), 1), dtype=torch.float32, device=device)
    for i, (_, p) in enumerate(named):
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if local.numel():
            # Two device-side reductions per parameter, one host sync for all (below).
            flags[0, i] = local.isnan().any()
            flags[1, i] = local.isinf().any()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    nan, inf = flags.cpu().bool().tolist()
    found = []
    for i, (name, _) in enumerate(named):
        if nan[i] or inf[i]:
            found.append((name, "nan+inf" if nan[i] and inf[i] else ("nan" if nan[i] else "inf")))
    return found


def check_finite_grads(
    model: nn.Module,
    step: int | None = None,
    action: Action = "raise",
    *,
    group: dist.ProcessGroup | None = None,
) -> bool:
    """After backward, before the optimizer: True when every gradient is finite on every rank.

    Otherwise, by `action`:
      "raise" - raise NonFiniteGradientError naming the step, the parameters and their modules
                (stop training; the message is the same on every rank);
      "skip"  - warn, and drop every gradient (set to None) so that the optimizer step that
                follows changes nothing; returns False so the loop can also skip it explicitly;
      "warn"  - warn and return False, leaving the gradients as they are.
    Every rank must call it (it runs one all-reduce of 2 flags per parameter); all ranks return
    the same value. Opt-in: it costs that all-reduce and a host sync per step.
    """
    if action not in _ACTIONS:
        raise ValueError(f"check_finite_grads: action must be one of {_ACTIONS}, got {action!r}")
    found = find_nonfinite_grads(model, group)
    if not found:
        return True
    params = [name for name, _ in found]
    modules = list(dict.fromkeys(_module_of(name) for name in params))
    message = _message(step, found, modules)
    if action == "raise":
        raise NonFiniteGradientError(message, step, params, modules)
    if action == "skip":
        for p in model.parameters():
            p.grad = None
        message += "; skipping this step (gradients dropped)"
    warnings.warn(message, NonFiniteGradientWarning, stacklevel=2)
    logger.warning(message)
    return False


def _message(step: int | None, found: list[tuple[str, str]], modules: list[str]) -> str:
    where = "" if step is None else f" at step {step}"
    listed = ", ".join(f"{name} ({kind})" for name, kind in found[:MAX_NAMED])
    more = f", and {len(found) - MAX_NAMED} more" if len(found) > MAX_NAMED else ""
    first_modules = ", ".join(modules[:MAX_NAMED]) + (", ..." if len(modules) > MAX_NAMED else "")
    return (
        f"non-finite gradients{where} in {len(found)} parameter(s): {listed}{more}; "
        f"modules: {first_modules}"
    )


def _module_of(param_name: str) -> str:
    # FSDP2 and TP keep the user's names; activation-checkpoint wrappers add this segment.
    parts = [p for p in param_name.split(".")[:-1] if p != "_checkpoint_wrapped_module"]
    return ".".join(parts) or "<root>"


def _device_of(named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the flags must live for `group`'s backend: NCCL reduces CUDA tensors only (also
    when cpu_offload keeps the gradients on the host), gloo reduces CPU tensors."""
    if dist.is_initialized():
        if "nccl" in str(dist.get_backend(group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    # No collective: keep the flags beside the gradients (one host sync at the end, not per param).
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named[:1]]
    return local[0].device if local and local[0].device.type != "meta" else torch.device("cpu")


class NonFiniteTrace:
    """Filled by `trace_nonfinite_forward`: the first module whose forward output was non-finite."""

    def __init__(self) -> None:
        self.first: str | None = None  # qualified module name, "" for the root
        self.kind: str | None = None  # "nan", "inf" or "nan+inf"


@contextmanager
def trace_nonfinite_forward(model: nn.Module) -> Iterator[NonFiniteTrace]:
    """Debugging aid: find the first module (in completion order, so the innermost one) whose
    forward output holds NaN or inf, on this rank.

        with smp.reliability.trace_nonfinite_forward(model) as trace:
            loss = model(**batch).loss
        if trace.first is not None: print("first non-finite output:", trace.first, trace.kind)

    Costs a device-to-host sync per module: use it to diagnose a step that
    `check_finite_grads` flagged, not on every step. Not a collective.
    """
    trace = NonFiniteTrace()

    def hook(name: str):
        def check(_module: nn.Module, _args: object, output: object) -> None:
            if trace.first is not None:
                return
            kind = _nonfinite_kind(output)
            if kind is not None:
                trace.first, trace.kind = name, kind

        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def _nonfinite_kind(output: object) -> str | None:
    nan = inf = False
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            nan = nan or bool(local.isnan().any())
            inf = inf or bool(local.isinf().any())
    if nan and inf:
        return "nan+inf"
    return "nan" if nan else ("inf" if inf else None)
