"""apply_tensor_parallel: one function for every model; families differ only in their plan."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from smp.errors import ConfigError, PlanError
from smp.tensor_parallel.styles import Options, make_style
from smp.tensor_parallel.tp_plan import StyleSpec, expand_plan, resolve_plan

# Per-module attributes some attention implementations read in forward (GPT-2: num_heads,
# split_size; user models: heads). Under TP each rank holds 1/tp of them. HF Llama-style
# attention reshapes with -1 and needs nothing here.
PER_RANK_ATTRS = ("num_heads", "num_key_value_heads", "num_kv_heads", "heads", "n_head", "n_heads", "split_size")


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, StyleSpec] | None = None,
    *,
    config_plan: dict[str, str] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Split `model`'s layers over `tp_mesh` by its plan (see tp_plan.py for where plans come from).

    `plan` (smp.transform's `tp_plan`) overrides `config_plan` (the config's
    `tensor_parallel.plan`), which overrides the model's own. Runs before FSDP: parameters
    become DTensors on the TP mesh, which fully_shard then shards further over the
    data-parallel axes.
    """
    tp = tp_mesh.size()
    resolved = resolve_plan(model, plan, config_plan)
    check_head_counts(model, tp)
    opts = Options(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    expanded = expand_plan(model, resolved, opts)
    divide_region_attrs(expanded.regions, tp)

    ties = _tied_parameters(model)
    applied: dict[str, str] = {}
    for a in expanded.assignments:
        style = a.style if isinstance(a.style, ParallelStyle) else make_style(a.style, a.module, opts, a.is_head)
        parallelize_module(a.module, tp_mesh, style)
        applied[a.name] = a.style if isinstance(a.style, str) else type(a.style).__name__
    _retie(ties)
    # For introspection and tests: what was applied where, and from which plan.
    model._smp_tp_plan = applied  # type: ignore[assignment]
    model._smp_tp_plan_source = resolved.source  # type: ignore[assignment]
    return model


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return cfg


def check_head_counts(model: nn.Module, tp: int) -> None:
    """Each rank must hold whole attention heads and whole key/value (GQA) groups."""
    cfg = _text_config(model)
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


def divide_region_attrs(regions: dict[str, nn.Module], tp: int) -> None:
    for name, module in regions.items():
        for attr in PER_RANK_ATTRS:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value % tp:
                raise ConfigError(
                    f"{name or type(module).__name__}.{attr}={value} is not divisible by "
                    f"tensor_parallel_degree={tp}; choose a tensor_parallel_degree that divides {value}"
                )
            setattr(module, attr, value // tp)


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
