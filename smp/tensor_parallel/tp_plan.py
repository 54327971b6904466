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

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from smp.config import ConfigError
from smp.errors import PlanError
from smp.tensor_parallel.styles import EXPERT_PARAM_STYLES, REFUSED_STYLES, STYLE_NAMES, Options, is_conv1d

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
# Styles that open a gathered region (Phi-3, OLMo2): the projection's output is gathered whole,
# so the parent computes on full activations (nothing per-rank); under sequence parallel it
# still gathers the sequence at its entry, and its `rowwise_split_input` closes it.
GATHERED_REGION_STYLES = {"colwise_gather_output", "colwise_rep"}


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
    # Layers inside an MoE block run on its gathered plain input even under sequence parallel.
    sequence_parallel: bool = True
    param_styles: dict[str, str] = field(default_factory=dict)  # `moe_tp_experts`: per parameter
    why: str = ""  # set on entries smp added itself, for `model._smp_tp_plan`


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


def _check_style_name(style: StyleSpec, pattern: str, source: str) -> None:
    if not isinstance(style, str) or style in STYLE_NAMES:
        return
    if style in REFUSED_STYLES:
        raise ConfigError(
            f"tensor-parallel plan ({source}): {pattern!r} has style {style!r}: "
            f"{REFUSED_STYLES[style]}; or set tensor_parallel_degree: 1"
        )
    raise ConfigError(
        f"tensor-parallel plan ({source}): unknown style {style!r} for {pattern!r}; "
        f"use one of: {', '.join(STYLE_NAMES)}, or pass a torch ParallelStyle object"
    )


def _match(plan: TPPlan, modules: dict[str, nn.Module], params: list[str]) -> tuple[dict[str, tuple[str, StyleSpec]], dict[str, str]]:
    """(module name -> (pattern, style), parameter name -> style). A later pattern does not
    override an earlier exact hit. Patterns naming a parameter (transformers' expert weights:
    `experts.gate_up_proj`) go to the second map."""
    out: dict[str, tuple[str, StyleSpec]] = {}
    param_styles: dict[str, str] = {}
    for pattern, style in plan.entries.items():
        _check_style_name(style, pattern, plan.source)
        regex = _pattern(pattern)
        hits = [n for n in modules if n and regex.fullmatch(n)]
        param_hits = [n for n in params if regex.fullmatch(n)] if not hits else []
        if not hits and not param_hits and plan.strict:
            raise ConfigError(
                f"tensor-parallel plan ({plan.source}): pattern {pattern!r} matches no module of "
                f"{next(iter(modules.values())).__class__.__name__}; names look like: "
                f"{', '.join(list(n for n in modules if n)[:8])}, ..."
            )
        for name in hits:
            out.setdefault(name, (pattern, style))
        for name in param_hits:
            if not isinstance(style, str) or style not in EXPERT_PARAM_STYLES:
                raise ConfigError(
                    f"tensor-parallel plan ({plan.source}): {pattern!r} names parameter {name!r} with "
                    f"style {style!r}; parameter entries take {', '.join(EXPERT_PARAM_STYLES)} (expert "
                    "weights under a 'moe_tp_experts' module; 'colwise' for per-head parameters under a "
                    "'local_params' module); point other entries at modules"
                )
            param_styles.setdefault(name, style)
    return out, param_styles


_ANY_MODULE_STYLES = (
    "sequence_parallel", "gather_sequence", "region_entry", "replicate_to_sequence",
    "replicated_with_grad_allreduce", "replicate", "moe_tp_experts", "whole_sequence", "replicate_params",
    "local_params",
)


def _check_module_type(name: str, module: nn.Module, style: StyleSpec, source: str) -> None:
    if not isinstance(style, str) or style in _ANY_MODULE_STYLES:
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


def _check_local_params(modules: dict[str, nn.Module], owners: set[str], param_styles: dict[str, str], source: str) -> None:
    """A `local_params` module runs on the local shards of its own parameters: each must be split
    by its own 'colwise' entry (by head, dim 0). One left whole would be read in full by every
    rank's share of the heads (a shape error, or worse a broadcast); refused, naming the entry."""
    for owner in sorted(owners):
        for pname, p in modules[owner].named_parameters(recurse=False):
            full = f"{owner}.{pname}"
            style = param_styles.get(full)
            if style is None and p.requires_grad:
                raise ConfigError(
                    f"tensor-parallel plan ({source}): {owner!r} has style 'local_params' but its parameter "
                    f"{full!r} {tuple(p.shape)} has no entry; add {full!r}: 'colwise' (one value per head, "
                    "split with the heads) or remove the 'local_params' entry"
                )
            if style is not None and style != "colwise":
                raise ConfigError(
                    f"tensor-parallel plan ({source}): {full!r} has style {style!r}; a parameter of a "
                    "'local_params' module takes 'colwise' (split on dim 0 with the heads)"
                )


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _in_width(module: nn.Module) -> int | None:
    """A Linear / Conv1D layer's input width."""
    if is_conv1d(module):
        return module.weight.shape[0]
    return getattr(module, "in_features", None)


def _is_inline(region: nn.Module, width: int | None) -> bool:
    """A region that also holds the residual stream's norms (attention and MLP computed inline in
    the block, like TinyTransformer's): a norm as wide as the region's input."""
    return any(
        _is_norm(m) and getattr(m, "weight", None) is not None and m.weight.shape[-1] == width
        for m in region.modules()
    )


def _head_dim(model: nn.Module, region: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    for owner in (region, cfg):
        dim = getattr(owner, "head_dim", None) or getattr(owner, "head_size", None)
        if isinstance(dim, int):
            return dim
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    return hidden // heads if heads and hidden else None


def _mla_regions(matched: dict[str, tuple[str, StyleSpec]]) -> set[str]:
    """Attention modules holding an `mla_kv_a_proj` layer (DeepSeek-V2-style latent attention)."""
    return {n.rpartition(".")[0] for n, (_, style) in matched.items() if style == "mla_kv_a_proj"}


def _mla_whole_input(model, matched, regions, widths, source: str) -> list[Assignment]:
    """The modules an MLA region's plan leaves whole that compute before the head split: a
    Linear reading the region's input (`q_a_proj`) and a norm over a latent that a colwise
    up-projection reads (`q_a_layernorm`, `kv_a_layernorm`). Such a region has no shared entry,
    so its inputs stay plain tensors and every colwise layer sums its own input gradient: these
    modules' gradients are then whole on every rank and need no sync ('replicate'). A norm as
    wide as a latent and as a head (it could be either) is refused, as are the rest by
    `_partial_grad_modules`."""
    extras: list[Assignment] = []
    for rname in sorted(_mla_regions(matched)):
        if rname not in regions:
            raise ConfigError(
                f"tensor-parallel plan ({source}): {rname!r} holds an 'mla_kv_a_proj' layer but none of "
                "its projections is split ('colwise'), so its rotary key gradient is already whole and "
                "summing it would double it; split its q / kv_b projections too, or remove the entry"
            )
        region, head_dim = regions[rname], _head_dim(model, regions[rname])
        latents = {_in_width(model.get_submodule(n)) for n, (_, style) in matched.items()
                   if style in REGION_STYLES and n.rpartition(".")[0] == rname}
        for sub, module in region.named_modules():
            name = f"{rname}.{sub}" if rname and sub else (rname or sub)
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own or any(n == name or name.startswith(n + ".") for n in matched):
                continue
            if isinstance(module, nn.Linear) and module.in_features == widths.get(rname):
                why = "auto: reads the MLA region's unsplit input"
            elif all(p.ndim == 1 and p.shape[0] in latents for p in own) and _is_norm(module):
                if head_dim in {p.shape[0] for p in own}:
                    raise PlanError(
                        f"tensor-parallel plan: {name!r} in the MLA region {rname!r} is as wide as both a "
                        f"latent and a head ({head_dim}), so smp cannot tell whether its gradient is whole "
                        f"or partial; say which in the plan: {name!r}: 'replicate' (a latent norm) or "
                        "'replicated_with_grad_allreduce' (a per-head norm)"
                    )
                why = "auto: norm of an MLA latent before its colwise up-projection"
            else:
                continue
            extras.append(Assignment(name, module, "replicate", why=why))
    return extras


def _runs_without_grad(module: nn.Module) -> bool:
    """Whether the module's forward is decorated with `@torch.no_grad()` (or
    `@torch.inference_mode()`): found from the decorator's closure, where torch keeps the context
    manager it enters on each call (torch/utils/_contextlib.py)."""
    forward = module.__dict__.get("forward", type(module).forward)
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            manager = getattr(cell.cell_contents, "__self__", None)
        except ValueError:  # an empty cell
            continue
        if isinstance(manager, torch.no_grad):
            return True
        if isinstance(manager, torch.inference_mode) and getattr(manager, "mode", False):
            return True
    return False


def _gradless_owner(region: nn.Module, rname: str, sub: str) -> str | None:
    """The module, from `region.<sub>` up to (not including) the region, whose forward runs
    without gradients (DeepSeek-V3.2 / HY-V4's top-k indexer): nothing under it gets a gradient,
    so its whole parameters are exact on every rank ('replicate'). None when there is none."""
    parts = sub.split(".") if sub else []
    for depth in range(len(parts), 0, -1):
        path = ".".join(parts[:depth])
        if _runs_without_grad(region.get_submodule(path)):
            return f"{rname}.{path}" if rname else path
    return None


def _partial_grad_modules(model, modules, assigned, regions, widths, split=frozenset()) -> list[Assignment]:
    """Replicated parameters inside a split region whose gradient each rank computes only partly.

    Between a colwise layer and its rowwise partner every rank holds only its heads/features: a
    parameter applied there (Qwen3's per-head q_norm/k_norm) is whole on every rank, yet each
    rank's gradient covers only its own heads. Left alone, training silently diverges from one
    process (norm gradients off by ~1e-3), so smp sums them over the TP group automatically,
    exactly like transformers' `replicated_with_grad_allreduce` (which the shipped plans name).
    What smp cannot prove per-rank is refused, naming the parameter and the two explicit entries.
    """
    extras: list[Assignment] = []
    for rname in sorted(regions):
        region, width = regions[rname], widths.get(rname)
        inline = _is_inline(region, width)
        head_dim = _head_dim(model, region)
        for sub, module in region.named_modules():
            name = f"{rname}.{sub}" if rname and sub else (rname or sub)
            own = [(n, p) for n, p in module.named_parameters(recurse=False)
                   if p.requires_grad and f"{name}.{n}" not in split]
            if not own or any(n == name or name.startswith(n + ".") for n in assigned):
                continue  # split by the plan, or inside a module the plan styles as a whole
            gradless = _gradless_owner(region, rname, sub)
            if gradless is not None:
                extras.append(Assignment(name, module, "replicate", why=(
                    f"auto: {gradless!r} runs its forward under torch.no_grad, so these parameters "
                    "get no gradient to be partial")))
                continue
            if all(p.shape[-1] == width for _, p in own) and inline:
                continue  # a residual-stream norm of an inline block: it sees the whole input
            if all(p.ndim == 1 and p.shape[0] == head_dim for _, p in own):
                extras.append(Assignment(name, module, "replicated_with_grad_allreduce",
                                         why=f"auto: per-head parameter inside the split region {rname!r}"))
                continue
            pname = f"{name}.{own[0][0]}"
            raise PlanError(
                f"tensor-parallel plan: {pname} {tuple(own[0][1].shape)} is replicated inside the split "
                f"region {rname!r} and smp cannot tell whether it acts on this rank's share of the heads "
                "(its gradient is then partial and must be summed over the TP ranks) or on the region's "
                f"whole input. Say which in the plan: {name!r}: 'replicated_with_grad_allreduce' (applied "
                f"after the split, like Qwen3's q_norm) or {name!r}: 'replicate' (applied to the unsplit "
                "input); or split it with the projections"
            )
    return extras


def expand_plan(model: nn.Module, plan: TPPlan, opts: Options) -> Expanded:
    modules = dict(model.named_modules())
    matched, param_styles = _match(plan, modules, [n for n, _ in model.named_parameters()])
    head = _head_name(model)
    if head is None:  # a user model: its head is the entry styled "lm_head", if any
        head = next((n for n, (_, s) in matched.items() if s == "lm_head"), None)
    embedding = _input_embedding_name(model)

    # A tied head and input embedding share one weight: both must be split the same way
    # (vocab rows: colwise head == row-wise embedding), so a sharded head brings the embedding.
    if head in matched and embedding and embedding not in matched:
        if modules[head].weight is modules[embedding].weight:
            matched[embedding] = ("<tied to the head>", "embedding_rowwise")

    experts = {n for n, (_, style) in matched.items() if style == "moe_tp_experts"}
    local_owners = {n for n, (_, style) in matched.items() if style == "local_params"}
    _check_local_params(modules, local_owners, param_styles, plan.source)
    for pname, style in param_styles.items():
        if pname.rpartition(".")[0] not in experts | local_owners:
            raise ConfigError(
                f"tensor-parallel plan ({plan.source}): parameter entry {pname!r} ({style!r}) needs its "
                f"module {pname.rpartition('.')[0]!r} styled 'moe_tp_experts' (expert weights) or "
                "'local_params' (per-head parameters such as attention sinks). Add that entry, or "
                "remove the parameter's"
            )
    moe_blocks = {n.rpartition(".")[0]: modules[n.rpartition(".")[0]] for n in experts}

    def in_moe_block(name: str) -> bool:
        return any(name.startswith(b + ".") for b in moe_blocks if b)

    out = Expanded()
    gathered: dict[str, nn.Module] = {}
    widths: dict[str, int | None] = {}
    for name, (_, style) in matched.items():
        _check_module_type(name, modules[name], style, plan.source)
        if style == "packed_rowwise":
            raise ConfigError(
                f"tensor-parallel plan ({plan.source}): 'packed_rowwise' on module {name!r}; smp reads it "
                "on expert parameters only (under a 'moe_tp_experts' module). Use 'rowwise' for a Linear"
            )
        parent = name.rpartition(".")[0]
        if isinstance(style, str) and style in REGION_STYLES and name != head:
            out.regions[parent] = modules[parent]
            widths.setdefault(parent, _in_width(modules[name]))
        elif isinstance(style, str) and style in GATHERED_REGION_STYLES and name != head:
            gathered[parent] = modules[parent]
            widths.setdefault(parent, _in_width(modules[name]))
        own = {p.rpartition(".")[2]: s for p, s in param_styles.items() if p.rpartition(".")[0] == name}
        out.assignments.append(Assignment(name, modules[name], style, is_head=(name == head),
                                          sequence_parallel=not in_moe_block(name), param_styles=own))

    whole_heads = sorted(local_owners - set(out.regions))
    if whole_heads:
        raise ConfigError(
            f"tensor-parallel plan ({plan.source}): {whole_heads[0]!r} has style 'local_params' but no projection "
            "inside it is split ('colwise'), so its heads stay whole and its split per-head parameters "
            "would not match them; split its q/k/v projections too, or remove the 'local_params' entry "
            "and its parameters'"
        )
    # A `local_params` module is split only in its named parameters: its submodules (per-head
    # norms) still go through the partial-gradient check.
    whole = {n: v for n, v in matched.items() if v[1] != "local_params"}
    # An MLA region's input width is what its `mla_kv_a_proj` layer reads: its first colwise layer
    # (`q_b_proj`) may read a latent instead.
    widths.update({n.rpartition(".")[0]: _in_width(modules[n]) for n, (_, s) in matched.items() if s == "mla_kv_a_proj"})
    mla_whole = _mla_whole_input(model, whole, out.regions, widths, plan.source)
    out.assignments += mla_whole
    whole.update({a.name: ("<MLA, whole input>", "replicate") for a in mla_whole})
    out.assignments += _partial_grad_modules(model, modules, whole, out.regions, widths, split=set(param_styles))

    if opts.sequence_parallel:
        out.assignments += _sequence_parallel_extras(model, modules, matched, out.regions, gathered,
                                                     moe_blocks, widths, head, in_moe_block)
    else:
        # One shared replicated input per region: one all-reduce of its gradient in backward.
        # Not for regions that also hold norms (attention inline in the block): their input
        # feeds the residual too, which must stay a plain tensor; nor for MLA regions, whose
        # whole modules (q_a_proj, latent norms) compute on plain tensors.
        out.assignments += [
            Assignment(rname, region, "region_entry")
            for rname, region in sorted(out.regions.items())
            if rname and not _is_inline(region, widths.get(rname)) and rname not in _mla_regions(matched)
        ]
    return out


def _sequence_parallel_extras(model, modules, matched, regions, gathered, moe_blocks, widths, head, in_moe_block) -> list[Assignment]:
    """Norms outside the regions run on the sequence shard; regions gather it at their entry;
    an MoE block gathers it for its router and experts and hands a shard back."""
    extras: list[Assignment] = []
    closing = {}
    for name, (_, style) in matched.items():
        if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
            closing[name.rpartition(".")[0]] = closing.get(name.rpartition(".")[0], 0) + 1
    for rname, region in sorted({**regions, **gathered}.items()):
        # A region holding the block's own norms (attention computed inline in the block) has no
        # place for the sequence gather between norm and projections. A gathered region's norms
        # see whole activations (OLMo2's q_norm), so there only a second closing layer (attention
        # and MLP in one module) tells.
        inline = _is_inline(region, widths.get(rname)) if rname in regions else closing.get(rname, 0) > 1
        if inline:
            raise ConfigError(
                f"sequence_parallel: {rname or type(model).__name__!r} holds both norm layers and "
                "the split projections, so smp cannot gather the sequence between them; put "
                "attention and MLP in their own submodules, or set tensor_parallel.sequence_parallel: false"
            )
        if in_moe_block(rname):  # e.g. DeepSeek-V3's shared experts: the block already gathered
            extras.append(Assignment(rname, region, "region_entry", sequence_parallel=False))
        elif rname in _mla_regions(matched):  # its whole modules compute on plain tensors
            extras.append(Assignment(rname, region, "whole_sequence"))
        else:
            extras.append(Assignment(rname, region, "gather_sequence"))
    for bname, block in sorted(moe_blocks.items()):
        if bname in regions or bname in gathered or not bname:
            raise ConfigError(
                f"sequence_parallel: {bname or type(model).__name__!r} holds both the MoE experts and "
                "split projections, so smp has no single place to gather the sequence; set "
                "tensor_parallel.sequence_parallel: false"
            )
        extras.append(Assignment(bname, block, "whole_sequence"))
    bounded = [r for r in (*regions, *gathered, *moe_blocks) if r]
    # A sibling of a region that the plan leaves whole (DeepSeek-V3's attention beside its split
    # MLP) computes on plain tensors: it takes the whole sequence and hands a shard back.
    blocks = {r.rpartition(".")[0] for r in bounded}
    # Every layer of a stack holding such a block is one too: AFMoE's dense first layer, whose
    # plan splits nothing, sits in the same `layers` list as its MoE layers.
    stacks = {b.rpartition(".")[0] for b in blocks if isinstance(modules.get(b.rpartition(".")[0]), nn.ModuleList)}
    blocks |= {n for n in modules if n and n.rpartition(".")[0] in stacks}
    for name, module in modules.items():
        if name.rpartition(".")[0] not in blocks or name in bounded or _is_norm(module) or name in matched:
            continue
        if any(name.startswith(b + ".") for b in bounded):
            continue  # inside a region or MoE block: it already runs on the whole sequence
        if any(n.startswith(name + ".") for n in matched) or isinstance(module, nn.Embedding):
            continue
        if any(p.requires_grad for p in module.parameters()):
            extras.append(Assignment(name, module, "whole_sequence"))
            bounded.append(name)
    for name, module in modules.items():
        inside = any(name.startswith(r + ".") for r in bounded)
        if _is_norm(module) and not inside and name not in matched:
            extras.append(Assignment(name, module, "sequence_parallel"))
        elif isinstance(module, nn.Embedding) and name not in matched and not inside:
            # e.g. GPT-2's position embedding, added to the sequence-sharded token embedding.
            extras.append(Assignment(name, module, "replicate_to_sequence"))
    # Anything else owning parameters meets the sequence-sharded stream at the model level
    # (HRM's z_L_init, DeepSeek-V4's hc_head): its parameters join it as Replicate DTensors.
    styled = [*bounded, *matched, *(a.name for a in extras)]
    for name, module in modules.items():
        if any(name == s or name.startswith(s + ".") for s in styled if s) or name in styled:
            continue
        if next(module.parameters(recurse=False), None) is not None:
            extras.append(Assignment(name, module, "replicate_params"))
    if head is None or head not in matched:
        raise ConfigError(
            "sequence_parallel needs the output head in the tensor-parallel plan (style "
            "'colwise_gather_output' or 'lm_head'), so that it gathers the sequence; add it, or set "
            "tensor_parallel.sequence_parallel: false"
        )
    return extras
