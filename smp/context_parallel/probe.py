"""The attention probe: before the first forward communicates, run it once on the meta device and
refuse a model whose attention smp cannot see.

Under context parallel every rank holds 1/cp of each sequence, so attention computed anywhere but
`smp.context_parallel.attention` (F.scaled_dot_product_attention inline, softmax(q @ k^T) by
hand, a third-party kernel) attends to this rank's chunk only and trains wrong without a sign.
Counting smp's attention calls after a forward catches a model that never calls it, but only
after FSDP's all-gathers ran, and not a model where one layer of many computes its own.

So the first forward is replayed first, on the meta device, from a forward pre-hook that runs
before FSDP's root pre-forward (both prepended; ours is registered after FSDP's): the parameters
and buffers are meta stand-ins of their shapes before FSDP sharded them (no memory), the inputs
meta copies of the real ones, every module's hooks are off (FSDP's all-gathers, tensor
parallel's redistributions) and smp's attention only counts its calls. Under a
TorchFunctionMode and a TorchDispatchMode the probe flags, naming the module:
- `F.scaled_dot_product_attention`, and any operator named like attention (aten's SDPA kernels,
  third-party attention ops);
- a batched matmul whose output ends in two dims equal to the local sequence length (q @ k^T),
  followed by a softmax over such a tensor: the hand-written form.
Any collective the forward itself would run aborts the probe before it communicates. All ranks
run the same code on the same shapes, so they decide alike: all raise, or none.

A probe that fails for a reason of its own (an operator without a meta kernel, a forward that
reads tensor values) warns and leaves the runtime check (`apply._require_attention_calls`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from smp._compat import SDPA_FUNCTIONS, TorchDispatchMode, op_name, tree_leaves, tree_map_only, without_hooks
from smp.context_parallel.attention import ContextParallelSetup
from smp.errors import SMPWarning, UsageError
from smp.meta_ops import shape_only_grouped_mm

FIX = "compute attention with smp.context_parallel.attention(q, k, v, causal=True)"

_MATMULS = {"aten::bmm", "aten::baddbmm"}  # what q @ k^T and einsum become on (B, H, L, D)
_SOFTMAXES = {"aten::_softmax", "aten::_safe_softmax", "aten::_log_softmax", "aten::softmax", "aten::log_softmax"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}


class ProbeAborted(Exception):
    """The probe could not run the forward on the meta device (not a finding about the model)."""


@dataclass
class ProbeReport:
    attention_calls: int = 0
    findings: list[tuple[str, str]] = field(default_factory=list)  # (module, what it computes)


@dataclass
class AttentionProbe:
    """What the probe needs, taken by `apply_context_parallel` before FSDP shards the model."""

    setup: ContextParallelSetup
    stand_ins: dict[str, torch.Tensor]  # parameter / buffer name -> meta tensor of its shape
    # Keyword inputs the probe leaves out: a Hugging Face model's loss inputs. The loss is no
    # attention, and under tensor parallel it needs the vocab-sharded logits and a collective.
    skipped_inputs: tuple[str, ...] = ()
    # The keyword inputs as the model's own input hook completes them (hf.with_padding_mask).
    prepare: Callable[[tuple, dict], dict] | None = None


def meta_stand_ins(model: nn.Module) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like each parameter and buffer as the module's forward sees it (a
    tensor-parallel DTensor by its local shape); taken before FSDP shards them."""

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        return torch.empty(local.shape, dtype=local.dtype, device="meta")

    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return {name: stand_in(t) for name, t in named.items()}


def install_attention_probe(model: nn.Module, probe: AttentionProbe) -> None:
    """Probe `model`'s first forward before anything else runs in it. Call after FSDP wrapped the
    model: prepended last, this hook runs before FSDP's root pre-forward (its all-gathers). It
    stays until a forward passes (or the probe cannot run), so a refused model stays refused."""
    setup = probe.setup

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            kept = {key: value for key, value in kwargs.items() if key not in probe.skipped_inputs}
            kept = probe.prepare(args, kept) if probe.prepare is not None else kept
            report = probe_forward(module, probe.stand_ins, setup, args, kept)
        except ProbeAborted as e:
            handle.remove()
            warnings.warn(
                f"context parallel: smp could not check {_class_name(module)}'s attention on the meta "
                f"device before the first forward ({e}); it checks this first forward as it runs "
                f"(F.scaled_dot_product_attention outside smp's attention) and that every forward calls "
                f"smp.context_parallel.attention", SMPWarning, stacklevel=2,
            )
            _watch_this_forward(module, setup.size)
            return
        check_report(report, _class_name(module), setup.size)
        handle.remove()

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


def _watch_this_forward(model: nn.Module, cp_size: int) -> None:
    """The fallback when the meta replay cannot run: watch the real forward that is starting for
    F.scaled_dot_product_attention (the common inline form) and raise after it. Later than the
    probe (its collectives have run) but loud, and on every rank alike."""
    report = ProbeReport(attention_calls=1)  # the call count is the runtime check's business
    names = {id(m): _describe(model, name, m) for name, m in model.named_modules()}
    watch = _Watch(set(), report)
    mode = _FunctionWatch(watch)
    tracking = _track_modules([m for m in model.modules() if m is not model], names, watch.modules)

    def done(*_: Any) -> None:
        mode.__exit__(None, None, None)
        for h in tracking + [finish]:
            h.remove()
        check_report(report, _class_name(model), cp_size)

    mode.__enter__()
    finish = model.register_forward_hook(done, always_call=True)


def check_report(report: ProbeReport, model_name: str, cp_size: int) -> None:
    """Raise UsageError naming the modules whose attention smp cannot see, or saying that smp's
    attention is never called."""
    if report.findings:
        shown = "; ".join(f"{module} calls {what}" for module, what in report.findings[:3])
        more = f" (and {len(report.findings) - 3} more)" if len(report.findings) > 3 else ""
        raise UsageError(
            f"context_parallel_degree={cp_size}: {shown}{more}: attention computed outside "
            f"smp.context_parallel.attention sees only this rank's chunk of each sequence; {FIX}"
        )
    if report.attention_calls == 0:
        raise UsageError(
            f"context_parallel_degree={cp_size}: {model_name}'s forward never called "
            f"smp.context_parallel.attention, so its attention saw only this rank's chunk of each "
            f"sequence; {FIX}"
        )


def probe_forward(model: nn.Module, stand_ins: dict[str, torch.Tensor], setup: ContextParallelSetup,
                  args: tuple, kwargs: dict) -> ProbeReport:
    """Run `model(*args, **kwargs)` on the meta device, bare, under the watch; raise ProbeAborted
    when it cannot run there."""
    meta_args, meta_kwargs = tree_map_only(torch.Tensor, _meta_like, (args, kwargs))
    # The local sequence length: dim 1 of the (batch, sequence, ...) inputs.
    lengths = {t.shape[1] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() >= 2}
    names = {id(m): _describe(model, name, m) for name, m in model.named_modules()}
    report = ProbeReport()
    watch = _Watch(lengths, report)
    calls_before = setup.calls
    setup.probing, setup.calls = True, 0
    try:
        with (_bare_modules(model, names, watch.modules), torch.no_grad(), shape_only_grouped_mm(),
              _FunctionWatch(watch), _OperatorWatch(watch)):
            functional_call(model, stand_ins, meta_args, meta_kwargs, strict=False)
    except ProbeAborted:
        raise
    except Exception as e:  # an op with no meta kernel, a value read on meta, ...: not the model's fault
        raise ProbeAborted(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        report.attention_calls = setup.calls
        setup.probing, setup.calls = False, calls_before
    return report


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if isinstance(t, DTensor) else t
    return torch.empty(local.shape, dtype=local.dtype, device="meta")


def _describe(model: nn.Module, name: str, module: nn.Module) -> str:
    return _class_name(model) if not name else f"{name} ({_class_name(module)})"


def _class_name(module: nn.Module) -> str:
    """The user's class name, not FSDP's subclass of it ("FSDPLlamaModel")."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


@contextlib.contextmanager
def _bare_modules(model: nn.Module, names: dict[int, str], stack: list[str]) -> Iterator[None]:
    """Every module of `model` without its hooks and compiled call (restored after), with two
    hooks of ours instead that keep `stack` = the modules being called, innermost last.
    Hooks (FSDP's, tensor parallel's, smp's own) and torch.compile's replacement of the call
    would make a call more than `forward`."""
    modules = list(model.modules())
    with without_hooks(modules):
        _track_modules(modules, names, stack)
        yield


def _track_modules(modules: list[nn.Module], names: dict[int, str], stack: list[str]) -> list:
    """Hooks that keep `stack` = the modules being called, innermost last; their handles."""
    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(functools.partial(_enter, stack, names[id(module)])))
        handles.append(module.register_forward_hook(functools.partial(_leave, stack), always_call=True))
    return handles


def _enter(stack: list[str], name: str, *_: Any) -> None:
    stack.append(name)


def _leave(stack: list[str], *_: Any) -> None:  # returns None: the module's output stays
    stack.pop()


class _Watch:
    """What the probed forward computes: attention outside smp's function (`report.findings`),
    attributed to the innermost module being called (`modules`)."""

    def __init__(self, lengths: set[int], report: ProbeReport) -> None:
        self.lengths = lengths
        self.report = report
        self.modules: list[str] = []
        self.scores_module: str | None = None  # where a (…, L, L) matmul last came out

    def flag(self, module: str | None, what: str) -> None:
        module = module or (self.modules[-1] if self.modules else "the model")
        if all(seen != module for seen, _ in self.report.findings):
            self.report.findings.append((module, what))

    def is_scores(self, t: Any) -> bool:
        """(batch..., L, L), L a local sequence length: attention scores. Batched only: a 2-D
        (tokens, E) router logit matrix is square when tokens = E experts."""
        return (isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == t.shape[-2]
                and t.shape[-1] in self.lengths)

    def on_operator(self, name: str, args: tuple, out: Any) -> None:
        if "attention" in name or "attn" in name:
            self.flag(None, name)
        elif name in _MATMULS and self.is_scores(out):
            self.scores_module = self.modules[-1] if self.modules else None
        elif name in _SOFTMAXES and self.scores_module is not None and self.is_scores(args[0]):
            self.flag(self.scores_module, "softmax(q @ k^T) itself")


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in SDPA_FUNCTIONS:
            self.watch.flag(None, "F.scaled_dot_product_attention")
        return func(*args, **(kwargs or {}))


class _OperatorWatch(TorchDispatchMode):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = op_name(func)  # "namespace::op"
        if name.split("::")[0] in _COLLECTIVE_NAMESPACES:
            raise ProbeAborted(f"its forward runs the collective {name}")
        out = func(*args, **(kwargs or {}))
        self.watch.on_operator(name, args, out)
        return out
