"""Where the expert-parallel plan comes from, and which modules and parameters it names.

A plan maps module-name patterns ("*" matches one name component) to one of two styles, the
vocabulary of transformers' `base_model_ep_plan`:

- "ep_dispatch_experts" on an experts module: its tokens travel to the ranks of their experts;
- "grouped_gemm" on one of its parameters: a [num_experts, ...] tensor split on dim 0.

In order of preference (smp/plans.py): the config's `moe.plan` (or `smp.transform(...,
moe_config=...)`), the model's own transformers plan (`config.base_model_ep_plan`: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, ...), smp's table by `model_type`. An experts module must follow
the contract in docs/expert-parallel.md: parameters [num_experts, ...] and
`forward(hidden [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])` that
returns [tokens, hidden] = sum over k of weight x expert(hidden), reading only its own
parameters, so that it also computes correctly on a slice of its experts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from smp import plans
from smp.errors import ConfigError

DISPATCH, GROUPED = "ep_dispatch_experts", "grouped_gemm"
STYLES = (DISPATCH, GROUPED)

# Plans for families whose config ships no `base_model_ep_plan`, by model_type (relative to the
# base model). Empty: every transformers 5.23 family with an experts module ships its own
# (tests/expert_parallel/test_expert_parallel.py::test_every_transformers_moe_family_ships_a_plan checks it);
# an entry here serves a model that does not.
SMP_TABLES: dict[str, dict[str, str]] = {}


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module the plan names: where, its expert count, the parameters split on dim 0."""

    name: str
    module: nn.Module
    num_experts: int
    param_names: tuple[str, ...]


# source, entries (pattern -> style); `strict` unused: the config's plan is checked by `expand_ep_plan`.
EPPlan = plans.Plan


# The styles of older transformers (5.17, the GPU image's) for the same modules: its own expert
# parallelism named the experts module "moe_tp_experts" and the router "ep_router". smp's
# dispatch needs only the experts module (the router runs whole on every rank, as in one
# process), so a model's own plan in that vocabulary is read as today's and the router dropped.
OLDER_STYLES: dict[str, str | None] = {"moe_tp_experts": DISPATCH, "ep_router": None}


def _current_styles(entries: dict[str, str]) -> dict[str, str]:
    translated = {p: OLDER_STYLES.get(s, s) for p, s in entries.items()}
    return {p: s for p, s in translated.items() if s is not None}


def resolve_ep_plan(model: nn.Module, config_plan: dict[str, str] | None) -> EPPlan:
    """The plan for `model`, by the precedence in the module docstring."""
    name = type(model).__name__
    found = plans.first_plan([
        EPPlan("moe.plan in the config", dict(config_plan or {})),
        EPPlan(f"{name}'s own transformers plan", _current_styles(plans.own_plan(model, "base_model_ep_plan"))),
        EPPlan(f"smp's table for model_type '{plans.model_type(model)}'", plans.table_plan(model, SMP_TABLES)),
    ])
    return found or EPPlan(f"none ({name} ships no base_model_ep_plan)", {})


def _matches(entries: dict[str, str], style: str, name: str) -> bool:
    return any(s == style and plans.matches(p, name) for p, s in entries.items())


def _forward_args(module: nn.Module) -> list[str]:
    params = inspect.signature(type(module).forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)][1:]


def _takes_routing(module: nn.Module) -> bool:
    """Its forward takes (hidden, top_k_index, top_k_weights) positionally (or *args)."""
    args = _forward_args(module)
    return len(args) >= 3 or any(inspect.Parameter.VAR_POSITIONAL == p.kind
                                 for p in inspect.signature(type(module).forward).parameters.values())


def expand_ep_plan(model: nn.Module, plan: EPPlan, degree: int) -> list[ExpertsModule]:
    """The experts modules `plan` names in `model`, checked against `degree` (experts per rank
    must be whole). Raises ConfigError naming the model, the expert count and the degree; runs
    no collective."""
    bad = {p: s for p, s in plan.entries.items() if s not in STYLES}
    if bad:
        raise ConfigError(f"expert-parallel plan ({plan.source}) has unknown styles {bad}; styles: {', '.join(STYLES)}")
    model_name = type(model).__name__
    found = []
    for name, module in model.named_modules():
        if not _matches(plan.entries, DISPATCH, name):
            continue
        params = dict(module.named_parameters(recurse=False))
        named = tuple(p for p in params if _matches(plan.entries, GROUPED, f"{name}.{p}"))
        names = named or tuple(params)  # a plan naming only the module splits all its own parameters
        rows = {p: params[p].shape[0] if params[p].dim() else 0 for p in names}
        num_experts = getattr(module, "num_experts", None) or next(iter(rows.values()), 0)
        if not names or any(r != num_experts for r in rows.values()) or not _takes_routing(module):
            raise ConfigError(
                f"{model_name}: experts module '{name}' ({type(module).__name__}) must hold "
                f"[num_experts={num_experts}, ...] parameters to split over expert_parallel_degree="
                f"{degree} and a forward(hidden_states, top_k_index, top_k_weights); its parameters "
                f"have leading sizes {rows or 'none'}, its forward takes {_forward_args(module)} "
                "(contract: docs/expert-parallel.md)"
            )
        if num_experts % degree:
            raise ConfigError(
                f"{model_name}: '{name}' holds {num_experts} experts, which expert_parallel_degree="
                f"{degree} does not divide; choose a degree that divides {num_experts}"
            )
        found.append(ExpertsModule(name, module, num_experts, names))
    if not found:
        raise ConfigError(
            f"expert_parallel_degree={degree} but {model_name} has no mixture-of-experts layer the "
            f"expert-parallel plan names (plan: {plan.source}: {plan.entries or '{}'}); use "
            "expert_parallel_degree: 1 for a dense model, or name its experts modules: "
            "moe: {plan: {'layers.*.moe.experts': 'ep_dispatch_experts'}}"
        )
    return found
