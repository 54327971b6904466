"""apply_tensor_parallel: one function for every model; families differ only in their plan."""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from smp._compat import check_sequence_parallel
from smp.anatomy import Anatomy
from smp.errors import ConfigError, PlanError
from smp.tensor_parallel import lora
from smp.tensor_parallel import registry as reg
from smp.tensor_parallel.loss import use_vocab_parallel_loss
from smp.tensor_parallel.registry import Options, build_style, text_config
from smp.tensor_parallel.rules import expand_plan
from smp.tensor_parallel.styles import is_conv1d
from smp.tensor_parallel.tp_plan import Matched, StyleSpec, resolve_plan

# Names of per-head sizes: never divided, even when their value equals a head count.
_PER_HEAD = ("dim", "size", "group")

def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, StyleSpec] | None = None,
    *,
    config_plan: dict[str, str] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    anatomy: Anatomy | None = None,
) -> nn.Module:
    """Split `model`'s layers over `tp_mesh` by its plan: tp_plan.py says where it comes from and
    what it names, rules.py what it implies, registry.py which ParallelStyle each name builds.

    `plan` (smp.transform's `tp_plan`) overrides `config_plan` (the config's
    `tensor_parallel.plan`), which overrides the model's own. Runs before FSDP: parameters
    become DTensors on the TP mesh, which fully_shard then shards further over the
    data-parallel axes.
    """
    if sequence_parallel:
        check_sequence_parallel()  # before any change to the model: refused on torch < 2.11
    if lora.tp_target(model) is not model:  # a PEFT model: its transformers model's plan (lora.py)
        model, anatomy = lora.tp_target(model), None
    lora.check_quantized(model, tp_mesh.device_type)  # QLoRA: refused, naming why
    tp = tp_mesh.size()
    resolved = resolve_plan(model, plan, config_plan, anatomy)
    check_head_counts(model, tp)
    opts = Options(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    expanded = expand_plan(model, resolved, opts, anatomy=anatomy)
    divide_region_attrs(expanded.regions, _split_widths(expanded), _head_counts(model), tp)

    ties = _tied_parameters(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    applied: dict[str, str] = {}
    for a in expanded.assignments:
        applied[a.name] = a.style if isinstance(a.style, str) else type(a.style).__name__
        if a.why:
            applied[a.name] += f" ({a.why})"
        style = build_style(a, opts, model)
        if style is None:  # declared whole on every rank, gradient whole too: nothing to do
            continue
        if lora.is_lora_layer(a.module):  # base split by the plan, adapters beside it (lora.py)
            lora.parallelize_lora(a.name, a.module, a.style, style, tp_mesh, a.sequence_parallel and sequence_parallel)
            continue
        parallelize_module(a.module, tp_mesh, style)
    _retie(ties)
    _keep_frozen(model, frozen)
    if loss_parallel:
        use_vocab_parallel_loss(model)
    # For introspection and tests: what was applied where, and from which plan.
    model._smp_tp_plan = applied  # type: ignore[assignment]
    model._smp_tp_plan_source = resolved.source  # type: ignore[assignment]
    return model


def _keep_frozen(model: nn.Module, frozen: set[str]) -> None:
    """Frozen parameters stay frozen: torch's SequenceParallel re-creates the parameters it
    replicates as trainable (a LoRA model's norms would train under sequence parallel)."""
    for name, p in model.named_parameters():
        if name in frozen and p.requires_grad:
            p.requires_grad_(False)


def check_head_counts(model: nn.Module, tp: int) -> None:
    """Each rank must hold whole attention heads and whole key/value (GQA) groups."""
    cfg = text_config(model)
    if cfg is None:
        return
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if kv and kv % tp:
        raise ConfigError(
            f"num_key_value_heads={kv} is not divisible by tensor_parallel_degree={tp}: each "
            f"tensor-parallel rank must hold whole key/value heads; choose a tensor_parallel_degree "
            f"that divides {kv}"
        )
    if heads and heads % tp:
        raise ConfigError(
            f"num_attention_heads={heads} is not divisible by tensor_parallel_degree={tp}; choose a "
            f"tensor_parallel_degree that divides {heads}"
        )


def _head_counts(model: nn.Module) -> set[int]:
    """The config's head counts (num_attention_heads, num_key_value_heads, n_head, ...), its
    sub-models' too (a VLM's vision tower, split by smp's table)."""
    cfg = text_config(model)
    if cfg is None:
        return set()
    top = getattr(model, "config", None)
    configs = [cfg, *(getattr(top, k, None) for k in (getattr(top, "sub_configs", None) or {}))]
    return {v for c in configs if c is not None for k, v in vars(c).items()
            if _is_count(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _is_count(name: str) -> bool:
    """A head count by its name (`num_heads`, `n_head`, `heads_per_rank`), not a per-head size."""
    return "head" in name and not any(w in name for w in _PER_HEAD)


def _split_widths(expanded: Matched) -> dict[str, set[int]]:
    """Region name -> the full output widths its split projections produce (each packed part
    counted alone): an attribute holding one of them holds a width TP divides."""
    widths: dict[str, set[int]] = {}
    for a in expanded.assignments:
        parent = a.name.rpartition(".")[0]
        if parent in expanded.regions and reg.fact(a.style, "opens_region"):
            layer = reg.base_layer(a.module)  # a LoRA layer's base (GPT-2's Conv1D)
            out = layer.weight.shape[1] if is_conv1d(layer) else layer.weight.shape[0]
            widths.setdefault(parent, set()).add(out // reg.STYLES[a.style].packed_parts)
    return widths


def _reads(cls: type) -> set[str] | None:
    """Attributes `self.X` and `self.config.X` (as 'config.X') that `cls` reads outside
    `__init__`; None when its source is unavailable (then every candidate counts as read)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            return None
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__":
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
                elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                      and node.value.attr == "config" and isinstance(node.value.value, ast.Name)
                      and node.value.value.id == "self"):
                    names.add("config." + node.attr)
    return names


def _divide(owner: Any, where: str, attr: str, value: int, tp: int) -> None:
    if value % tp:
        raise ConfigError(
            f"{where}.{attr}={value} is not divisible by tensor_parallel_degree={tp}; choose a "
            f"tensor_parallel_degree that divides {value}"
        )
    setattr(owner, attr, value // tp)


def divide_region_attrs(regions: dict[str, nn.Module], widths: dict[str, set[int]], head_counts: set[int], tp: int) -> None:
    """Per-rank values for the counts a split region's code reads: under TP each rank holds
    1/tp of its heads, so `self.num_attention_heads` (GPT-J), `self.num_heads` / `self.split_size`
    (GPT-2), `self.heads` (a user model), `self.config.num_attention_heads` (a module computing
    offsets from its config) must say so. Found, not listed: an int attribute the module reads
    outside `__init__` that is a head count (named like one and, when the model has a config,
    equal to one of its head counts) or a split width (equal to a split projection's full output
    width, e.g. embed_dim, split_size, all_head_size). A module reading its config gets its own
    copy with per-rank counts; the model's config is left whole."""
    for name, module in regions.items():
        where = name or type(module).__name__
        reads = _reads(type(module))
        region_widths = widths.get(name, set())
        for attr, value in list(vars(module).items()):
            if not isinstance(value, int) or isinstance(value, bool) or attr.startswith("_"):
                continue
            if reads is not None and attr not in reads:
                continue
            is_count = _is_count(attr) and (not head_counts or value in head_counts)
            is_width = value in region_widths and not _is_count(attr) and attr not in ("head_dim", "head_size")
            if is_count or is_width:
                _divide(module, where, attr, value, tp)
        cfg = getattr(module, "config", None)
        if cfg is None or not hasattr(cfg, "to_dict"):
            continue
        counts = [
            a for a in (r.partition(".")[2] for r in (reads or ()) if r.startswith("config."))
            if _is_count(a) and isinstance(getattr(cfg, a, None), int) and not isinstance(getattr(cfg, a), bool)
        ]
        if counts:
            module.config = cfg = copy.copy(cfg)
            for attr in counts:
                _divide(cfg, where + ".config", attr, getattr(cfg, attr), tp)


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that share one Parameter (e.g. a tied LM head)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """parallelize_module replaces each module's parameters: make tied ones one object again."""
    for group in groups:
        params = [getattr(m, n) for m, n in group]
        first = params[0]
        kinds = {(type(p).__name__, tuple(p.placements) if isinstance(p, DTensor) else None) for p in params}
        if len(kinds) > 1:
            raise PlanError(
                "tensor-parallel plan splits tied parameters differently ("
                + ", ".join(f"{type(m).__name__}.{n}" for m, n in group)
                + "); give the tied modules matching styles (head 'colwise_gather_output' with "
                "embedding 'embedding_rowwise'), or none"
            )
        for m, n in group[1:]:
            m.register_parameter(n, first)
