"""Plans: dicts from module-name patterns to values, shared by every parallelism that names modules.

A plan maps patterns to values (a tensor-parallel style name, an expert-parallel style, later a
pipeline stage). A pattern is a module or parameter name relative to the model given to
`smp.transform` in which `*` matches one dotted component (`layers.*.mlp.up_proj`).

Where a plan comes from, first non-empty wins:
  1. the user (an argument of `smp.transform`),
  2. the config,
  3. the model's own transformers plan (`base_model_tp_plan`, `base_model_ep_plan`, ...),
  4. smp's table, by the config's `model_type`.

The tables of smp's own plans (`smp.tensor_parallel.SMP_TABLES`, `smp.expert_parallel.SMP_TABLES`)
are written relative to the base model (`model.model` of a `LlamaForCausalLM`), as transformers'
`base_model_*_plan` are; `under_base` puts them under the model's base prefix.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Generic, Iterable, Mapping, TypeVar

from torch import nn

V = TypeVar("V")


@dataclass
class Plan(Generic[V]):
    """A resolved plan and where it came from."""

    source: str  # for messages: "tp_plan argument of smp.transform", "moe.plan in the config", ...
    entries: dict[str, V]
    strict: bool = False  # user-written: a pattern that matches nothing is an error (a typo)


@functools.lru_cache(maxsize=4096)
def pattern(p: str) -> re.Pattern[str]:
    """The regex of pattern `p`: `*` matches one dotted component, everything else literally."""
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", p)))


def matches(p: str, name: str) -> bool:
    """Whether pattern `p` names `name` (the whole name, not a prefix)."""
    return pattern(p).fullmatch(name) is not None


def names_matching(p: str, names: Iterable[str]) -> list[str]:
    """The names (in their order) that pattern `p` names."""
    regex = pattern(p)
    return [n for n in names if regex.fullmatch(n)]


def value_of(entries: Mapping[str, V], name: str, default: V | None = None) -> V | None:
    """The value of the first pattern (in the plan's order) that names `name`, else `default`."""
    return next((v for p, v in entries.items() if matches(p, name)), default)


def base_prefix(model: nn.Module) -> str:
    """'model.' for LlamaForCausalLM (its base model lives at `model.model`), '' for a base model."""
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    return next((name + "." for name, child in model.named_children() if child is base), "")


def under_base(model: nn.Module, entries: Mapping[str, V]) -> dict[str, V]:
    """`entries` written relative to the base model, as patterns relative to `model`."""
    prefix = base_prefix(model)
    return {prefix + k: v for k, v in entries.items()}


def model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def own_plan(model: nn.Module, config_attr: str, composed: Mapping | None = None) -> dict:
    """The model's own transformers plan: `composed` where transformers composes it for the
    whole model (its `_tp_plan`: `smp._compat.model_tp_plan`), else `model.config.<config_attr>`
    under the base prefix."""
    if composed:
        return dict(composed)
    return under_base(model, getattr(getattr(model, "config", None), config_attr, None) or {})


def table_plan(model: nn.Module, tables: Mapping[str, Mapping[str, V]]) -> dict[str, V]:
    """smp's table for the model's `model_type` under its base prefix; {} when there is none."""
    return under_base(model, tables.get(model_type(model), {}))  # type: ignore[arg-type]


def nested_tables(model: nn.Module, tables: Mapping[str, Mapping[str, V]]) -> dict[str, dict[str, V]]:
    """smp's tables for the sub-models inside `model`: each submodule with a config of its own
    whose `model_type` has a table (LLaVA's CLIP vision tower), by its module name, with the
    table's patterns under that name. The outermost such submodule wins; `model` itself is not
    one."""
    out: dict[str, dict[str, V]] = {}
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in out):
            continue
        entries = tables.get(model_type(module))  # type: ignore[arg-type]
        if entries and getattr(module, "config", None) is not getattr(model, "config", None):
            out[name] = {f"{name}.{k}": v for k, v in under_base(module, entries).items()}
    return out


def first_plan(candidates: Iterable[Plan[V]]) -> Plan[V] | None:
    """The first candidate with entries: pass them in precedence order (user, config, model, table)."""
    return next((c for c in candidates if c.entries), None)
