"""Tensor-parallel plans: data mapping module-name patterns to style names.

A plan comes from, in order:
  1. the user: `smp.transform(model, tp_plan=...)`, else `tensor_parallel.plan` in the config;
  2. the model's own transformers plan (`model._tp_plan`, which transformers 5.x composes from
     `config.base_model_tp_plan`; Llama, Mistral, Qwen2/3, Gemma, Phi3, GPT-NeoX, ...);
  3. smp's table below, for families transformers ships without one (GPT-2, older GPT-NeoX).

Patterns are module names relative to the model given to `smp.transform`; `*` matches one
dotted component (`layers.*.mlp.up_proj`). `expand_plan` turns a plan into concrete
(module name -> style) assignments, adding what the options imply (sequence-parallel norms,
region entries, a vocab-parallel input embedding for a tied head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from smp.config import ConfigError
from smp.tensor_parallel.styles import STYLE_NAMES, Options, is_conv1d

StyleSpec = Union[str, ParallelStyle]

# Relative to the base model (`model.base_model`); the output head is added from
# `get_output_embeddings()`. Fused projections whose parts are laid out [q | k | v] need the
# packed style; GPT-NeoX's fused qkv is laid out per head, so plain colwise keeps heads whole.
SMP_TABLES: dict[str, dict[str, str]] = {
    "gpt2": {
        "wte": "embedding_rowwise",
        "h.*.attn.c_attn": "packed_qkv_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    "gpt_neox": {
        "embed_in": "embedding_rowwise",
        "layers.*.attention.query_key_value": "colwise",
        "layers.*.attention.dense": "rowwise",
        "layers.*.mlp.dense_h_to_4h": "colwise",
        "layers.*.mlp.dense_4h_to_h": "rowwise",
    },
}
HEAD_STYLE = "colwise_gather_output"

# Styles that open a TP region: their parent module (attention, MLP) computes on per-rank heads
# or features, and under sequence parallel gathers the sequence at its entry.
REGION_STYLES = {"colwise", "packed_colwise", "packed_qkv_colwise"}


@dataclass
class TPPlan:
    source: str  # where it came from, for messages: "tp_plan argument", "model's own plan", ...
    entries: dict[str, StyleSpec]
    strict: bool  # user plans: a pattern that matches nothing is an error (a typo)


@dataclass
class Assignment:
    name: str
    module: nn.Module
    style: StyleSpec
    is_head: bool = False


@dataclass
class Expanded:
    assignments: list[Assignment] = field(default_factory=list)
    regions: dict[str, nn.Module] = field(default_factory=dict)  # parents of region-opening layers


def _base_prefix(model: nn.Module) -> str:
    """'model.' for LlamaForCausalLM (its base model lives at model.model), '' for a base model."""
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    for name, module in model.named_children():
        if module is base:
            return name + "."
    return ""


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None) if module is not None else None


def _head_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    return _name_of(model, get() if callable(get) else None)


def _input_embedding_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    return _name_of(model, emb)


def resolve_plan(model: nn.Module, user_plan: dict[str, StyleSpec] | None, config_plan: dict[str, str] | None) -> TPPlan:
    """The plan to use for `model`, by the precedence in the module docstring."""
    if user_plan:
        return TPPlan("tp_plan argument of smp.transform", dict(user_plan), strict=True)
    if config_plan:
        return TPPlan("tensor_parallel.plan in the config", dict(config_plan), strict=True)
    own = getattr(model, "_tp_plan", None) or {}
    if not own:
        base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        own = {_base_prefix(model) + k: v for k, v in base_plan.items()}
    if own:
        return TPPlan(f"{type(model).__name__}'s own transformers plan", dict(own), strict=False)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in SMP_TABLES:
        entries: dict[str, StyleSpec] = {_base_prefix(model) + k: v for k, v in SMP_TABLES[model_type].items()}
        head = _head_name(model)
        if head:
            entries[head] = HEAD_STYLE
        return TPPlan(f"smp's table for model_type '{model_type}'", entries, strict=False)
    raise ConfigError(
        f"tensor_parallel_degree > 1 but {type(model).__name__} has no tensor-parallel plan: it ships "
        "none (no `_tp_plan` / `config.base_model_tp_plan`) and smp's table has none for its "
        f"model_type {model_type!r} (known: {', '.join(sorted(SMP_TABLES))}). Pass one: "
        "smp.transform(model, tp_plan={'layers.*.attn.q_proj': 'colwise', "
        "'layers.*.attn.o_proj': 'rowwise', ...}) or `tensor_parallel: {plan: {...}}` in the config; "
        f"styles: {', '.join(STYLE_NAMES)}"
    )


def _pattern(p: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", p)))


def _match(plan: TPPlan, modules: dict[str, nn.Module]) -> dict[str, tuple[str, StyleSpec]]:
    """Module name -> (pattern, style). A later pattern does not override an earlier exact hit."""
    out: dict[str, tuple[str, StyleSpec]] = {}
    for pattern, style in plan.entries.items():
        if isinstance(style, str) and style not in STYLE_NAMES:
            raise ConfigError(
                f"tensor-parallel plan ({plan.source}): unknown style {style!r} for {pattern!r}; "
                f"use one of: {', '.join(STYLE_NAMES)}, or pass a torch ParallelStyle object"
            )
        regex = _pattern(pattern)
        hits = [n for n in modules if n and regex.fullmatch(n)]
        if not hits and plan.strict:
            raise ConfigError(
                f"tensor-parallel plan ({plan.source}): pattern {pattern!r} matches no module of "
                f"{next(iter(modules.values())).__class__.__name__}; names look like: "
                f"{', '.join(list(n for n in modules if n)[:8])}, ..."
            )
        for name in hits:
            out.setdefault(name, (pattern, style))
    return out


def _check_module_type(name: str, module: nn.Module, style: StyleSpec, source: str) -> None:
    if not isinstance(style, str) or style in ("sequence_parallel", "gather_sequence", "region_entry", "replicate_to_sequence"):
        return
    if style.startswith("embedding"):
        ok = isinstance(module, nn.Embedding)
    else:
        ok = isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module)
        ok = ok and not (style.startswith("packed") and isinstance(module, nn.Embedding))
    if not ok:
        raise ConfigError(
            f"tensor-parallel plan ({source}): style {style!r} cannot split {name!r} "
            f"({type(module).__name__}); it applies to nn.Linear / Conv1D"
            f"{' and nn.Embedding' if not style.startswith('packed') else ''}. Point the pattern at "
            "the projection layers inside the module, or pass a torch ParallelStyle object"
        )


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def expand_plan(model: nn.Module, plan: TPPlan, opts: Options) -> Expanded:
    modules = dict(model.named_modules())
    matched = _match(plan, modules)
    head = _head_name(model)
    if head is None:  # a user model: its head is the entry styled "lm_head", if any
        head = next((n for n, (_, s) in matched.items() if s == "lm_head"), None)
    embedding = _input_embedding_name(model)

    # A tied head and input embedding share one weight: both must be split the same way
    # (vocab rows: colwise head == row-wise embedding), so a sharded head brings the embedding.
    if head in matched and embedding and embedding not in matched:
        if modules[head].weight is modules[embedding].weight:
            matched[embedding] = ("<tied to the head>", "embedding_rowwise")

    out = Expanded()
    for name, (_, style) in matched.items():
        _check_module_type(name, modules[name], style, plan.source)
        if isinstance(style, str) and style in REGION_STYLES and name != head:
            parent = name.rpartition(".")[0]
            out.regions[parent] = modules[parent]
        out.assignments.append(Assignment(name, modules[name], style, is_head=(name == head)))

    if opts.sequence_parallel:
        out.assignments += _sequence_parallel_extras(model, modules, matched, out.regions, head)
    else:
        # One shared replicated input per region: one all-reduce of its gradient in backward.
        # Not for regions that also hold norms (attention inline in the block): their input
        # feeds the residual too, which must stay a plain tensor.
        out.assignments += [
            Assignment(rname, region, "region_entry")
            for rname, region in sorted(out.regions.items())
            if rname and not _holds_norms(region)
        ]
    return out


def _holds_norms(region: nn.Module) -> bool:
    return any(_is_norm(m) and not ("q_norm" in n or "k_norm" in n) for n, m in region.named_modules())


def _sequence_parallel_extras(model, modules, matched, regions, head) -> list[Assignment]:
    """Norms outside the regions run on the sequence shard; regions gather it at their entry."""
    extras: list[Assignment] = []
    region_names = sorted(regions)
    for rname in region_names:
        # A region holding the block's own norms (attention computed inline in the block) has no
        # place for the sequence gather between norm and projections.
        if _holds_norms(regions[rname]):
            raise ConfigError(
                f"sequence_parallel: {rname or type(model).__name__!r} holds both norm layers and "
                "the split projections, so smp cannot gather the sequence between them; put "
                "attention and MLP in their own submodules, or set tensor_parallel.sequence_parallel: false"
            )
        extras.append(Assignment(rname, regions[rname], "gather_sequence"))
    for name, module in modules.items():
        inside = any(name.startswith(r + ".") for r in region_names if r)
        if _is_norm(module) and not inside and name not in matched:
            extras.append(Assignment(name, module, "sequence_parallel"))
        elif isinstance(module, nn.Embedding) and name not in matched and not inside:
            # e.g. GPT-2's position embedding, added to the sequence-sharded token embedding.
            extras.append(Assignment(name, module, "replicate_to_sequence"))
    if head is None or head not in matched:
        raise ConfigError(
            "sequence_parallel needs the output head in the tensor-parallel plan (style "
            "'colwise_gather_output' or 'lm_head'), so that it gathers the sequence; add it, or set "
            "tensor_parallel.sequence_parallel: false"
        )
    return extras
