"""Tensor-parallel plans: where a plan comes from, and what it names in a model.

A plan comes from, in order (smp/plans.py):
  1. the user: `smp.transform(model, tp_plan=...)`, else `tensor_parallel.plan` in the config;
  2. the model's own transformers plan (`model._tp_plan`, which transformers 5.x composes from
     `config.base_model_tp_plan`; Llama, Mistral, Qwen2/3, Gemma, Phi3, GPT-NeoX, ...);
  3. smp's table below, for families transformers ships without one (GPT-2, older GPT-NeoX).

`match` turns a plan into a `Matched`: the modules and parameters its patterns name, each
checked against its style (registry.py), and the facts the plan rules read (which modules are
split regions, MoE blocks, the output head). What the plan implies beyond its entries
(sequence-parallel norms, region entries, per-head gradients) is inferred by rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from smp import plans
from smp._compat import model_tp_plan
from smp.anatomy import Anatomy, describe
from smp.errors import ConfigError
from smp.tensor_parallel import registry as reg
from smp.tensor_parallel.lora import is_lora_layer
from smp.tensor_parallel.registry import Assignment, StyleSpec
from smp.tensor_parallel.styles import is_conv1d


def _attention_mlp(layers: str, attention: str, out: str, up: str, down: str) -> dict[str, str]:
    """A transformer layer stack's plan: q/k/v split by heads, the attention output by rows,
    the MLP's up projection by columns and its down projection by rows."""
    return {
        **{f"{layers}.*.{attention}.{p}_proj": "colwise" for p in ("q", "k", "v")},
        f"{layers}.*.{attention}.{out}": "rowwise",
        f"{layers}.*.{up}": "colwise",
        f"{layers}.*.{down}": "rowwise",
    }


# Relative to the base model (`model.base_model`); the output head is added from
# `get_output_embeddings()`. Fused projections whose parts are laid out [q | k | v] need the
# packed style; GPT-NeoX's fused qkv is laid out per head, so plain colwise keeps heads whole.
# Vision encoders (ViT, DINOv2, CLIP, SigLIP, Mllama's tower) and Whisper split their attention
# and MLP like a decoder; patch/conv front-ends, position embeddings, pooling heads, classifiers and the
# contrastive projections stay whole.
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
    "vit": _attention_mlp("layers", "attention", "o_proj", "mlp.fc1", "mlp.fc2"),
    "dinov2": _attention_mlp("encoder.layer", "attention", "o_proj", "mlp.fc1", "mlp.fc2"),
    **{t: _attention_mlp("encoder.layers", "self_attn", "out_proj", "mlp.fc1", "mlp.fc2")
       for t in ("clip_vision_model", "clip_text_model", "siglip_vision_model", "siglip_text_model")},
    **{t: {**_attention_mlp("text_model.encoder.layers", "self_attn", "out_proj", "mlp.fc1", "mlp.fc2"),
           **_attention_mlp("vision_model.encoder.layers", "self_attn", "out_proj", "mlp.fc1", "mlp.fc2")}
       for t in ("clip", "siglip")},
    # Llama 3.2 Vision: a ViT-style tower (local and global encoder layers) and a Llama decoder
    # whose cross-attention layers read the tower's states; embeddings stay whole.
    "mllama": {
        **_attention_mlp("vision_model.transformer.layers", "self_attn", "o_proj", "mlp.fc1", "mlp.fc2"),
        **_attention_mlp("vision_model.global_transformer.layers", "self_attn", "o_proj", "mlp.fc1", "mlp.fc2"),
        **{f"language_model.layers.*.{attention}.{p}_proj": "colwise"
           for attention in ("self_attn", "cross_attn") for p in ("q", "k", "v")},
        "language_model.layers.*.self_attn.o_proj": "rowwise",
        "language_model.layers.*.cross_attn.o_proj": "rowwise",
        "language_model.layers.*.mlp.gate_proj": "colwise",
        "language_model.layers.*.mlp.up_proj": "colwise",
        "language_model.layers.*.mlp.down_proj": "rowwise",
    },
    "whisper": {
        **_attention_mlp("encoder.layers", "self_attn", "out_proj", "fc1", "fc2"),
        **_attention_mlp("decoder.layers", "self_attn", "out_proj", "fc1", "fc2"),
        **_attention_mlp("decoder.layers", "encoder_attn", "out_proj", "fc1", "fc2"),
        "decoder.embed_tokens": "embedding_rowwise",  # tied to the head, `proj_out`
    },
}
HEAD_STYLE = reg.HEAD

TPPlan = plans.Plan  # source, entries (pattern -> StyleSpec), strict


@dataclass
class Matched:
    """What a plan names in a model, and the facts the rules read."""

    model: nn.Module
    source: str
    modules: dict[str, nn.Module]
    entries: dict[str, tuple[str, StyleSpec]]  # module name -> (pattern, style), in plan order
    param_styles: dict[str, str]  # parameter name -> style (expert weights, per-head parameters)
    head: str | None  # the output head's module name
    embedding: str | None  # the input embedding's module name
    assignments: list[Assignment] = field(default_factory=list)  # the plan's, then each rule's
    regions: dict[str, nn.Module] = field(default_factory=dict)  # parents of region-opening layers
    gathered: dict[str, nn.Module] = field(default_factory=dict)  # parents of gathered-region openers
    widths: dict[str, int | None] = field(default_factory=dict)  # region -> its input width
    moe_blocks: dict[str, nn.Module] = field(default_factory=dict)  # parents of moe_tp_experts modules
    # Where sequence parallel applies: the language model holding the input embedding ('' = the
    # whole model). `sp_entry`: the module whose `inputs_embeds` enter the sequence shards when a
    # multimodal wrapper around it embeds the tokens (LLaVA's language model), else None (the
    # stream is sharded at the embedding).
    sp_scope: str = ""
    sp_entry: str | None = None

    def styled_as(self, style: str) -> list[str]:
        """The module names the plan gives `style`."""
        return [n for n, (_, s) in self.entries.items() if s == style]

    def in_moe_block(self, name: str) -> bool:
        return any(name.startswith(b + ".") for b in self.moe_blocks if b)

    def assigned(self) -> set[str]:
        return {a.name for a in self.assignments}

    def in_sp_scope(self, name: str) -> bool:
        return not self.sp_scope or name == self.sp_scope or name.startswith(self.sp_scope + ".")

    def runs_sequence_parallel(self, name: str) -> bool:
        """Whether a module the plan splits computes on the sequence-sharded stream (when sequence
        parallel is on): not inside an MoE block (it runs on the block's gathered input), not
        outside the language model (a vision tower), not the embedding of a wrapped language
        model (its wrapper edits the embeddings first); the output head gathers it back."""
        if name == self.head:
            return True
        return not self.in_moe_block(name) and self.in_sp_scope(name) and not (
            self.sp_entry is not None and name == self.embedding)


def _language_model(model: nn.Module, embedding: str | None, decoder: str | None) -> tuple[str, str | None]:
    """(sp_scope, sp_entry) of `Matched`: the decoder transformers names (`get_decoder()`, the
    anatomy's `decoder`) when it holds the input embedding, and whether the base model wraps it
    (a multimodal model)."""
    if not decoder or not embedding or not embedding.startswith(decoder + "."):
        return "", None
    base = plans.base_prefix(model)
    wrapped = decoder.startswith(base) and decoder != base[:-1] if base else True
    return decoder, decoder if wrapped else None


def _smp_table(model: nn.Module, anatomy: Anatomy) -> dict[str, StyleSpec]:
    entries: dict[str, StyleSpec] = dict(plans.table_plan(model, SMP_TABLES))
    head = anatomy.head if entries else None
    if head:
        entries[head] = HEAD_STYLE
    return entries


def _complete_with_nested_tables(model: nn.Module, plan: TPPlan) -> None:
    """A model's own plan (or smp's table) covers its own layers; a sub-model it leaves out that
    smp's table knows (LLaVA's CLIP vision tower, Gemma3's SigLIP) is split by that table too,
    so that a large vision tower is not whole on every TP rank. A sub-model the plan already
    names a module of is left to the plan; user plans are taken as written."""
    names = [n for n, _ in model.named_modules()]
    named = {n for p in plan.entries for n in plans.names_matching(p, names)}
    for sub, entries in plans.nested_tables(model, SMP_TABLES).items():
        if any(n.startswith(sub + ".") for n in named):
            continue
        plan.entries.update(entries)
        plan.source += f" + smp's table for {sub} (model_type '{plans.model_type(model.get_submodule(sub))}')"


def resolve_plan(model: nn.Module, user_plan: dict[str, StyleSpec] | None, config_plan: dict[str, str] | None,
                 anatomy: Anatomy | None = None) -> TPPlan:
    """The plan to use for `model`, by the precedence in the module docstring. `anatomy`: the
    picture already taken of `model` (smp/anatomy.py), read for its head."""
    model_type = plans.model_type(model)
    found = plans.first_plan([
        TPPlan("tp_plan argument of smp.transform", dict(user_plan or {}), strict=True),
        TPPlan("tensor_parallel.plan in the config", dict(config_plan or {}), strict=True),
        TPPlan(f"{type(model).__name__}'s own transformers plan",
               plans.own_plan(model, "base_model_tp_plan", composed=model_tp_plan(model))),
        TPPlan(f"smp's table for model_type '{model_type}'", _smp_table(model, anatomy or describe(model))),
    ])
    if found is not None and not found.strict:
        _complete_with_nested_tables(model, found)
    if found is not None:
        return found
    raise ConfigError(
        f"tensor_parallel_degree > 1 but {type(model).__name__} has no tensor-parallel plan: it ships "
        "none (no `_tp_plan` / `config.base_model_tp_plan`) and smp's table has none for its "
        f"model_type {model_type!r} (known: {', '.join(sorted(SMP_TABLES))}). Pass one: "
        "smp.transform(model, tp_plan={'layers.*.attn.q_proj': 'colwise', "
        "'layers.*.attn.o_proj': 'rowwise', ...}) or `tensor_parallel: {plan: {...}}` in the config; "
        f"styles: {', '.join(reg.STYLE_NAMES)}"
    )


# --- matching and the checks on what the plan names -------------------------------------------

def _check_style_name(style: StyleSpec, pattern: str, source: str) -> None:
    if not isinstance(style, str) or style in reg.STYLE_NAMES:
        return
    if style in reg.REFUSED_STYLES:
        raise ConfigError(
            f"tensor-parallel plan ({source}): {pattern!r} has style {style!r}: "
            f"{reg.REFUSED_STYLES[style]}; or set tensor_parallel_degree: 1"
        )
    raise ConfigError(
        f"tensor-parallel plan ({source}): unknown style {style!r} for {pattern!r}; "
        f"use one of: {', '.join(reg.STYLE_NAMES)}, or pass a torch ParallelStyle object"
    )


def _match_entries(plan: TPPlan, modules: dict[str, nn.Module], params: list[str]) -> tuple[dict[str, tuple[str, StyleSpec]], dict[str, str]]:
    """(module name -> (pattern, style), parameter name -> style). A later pattern does not
    override an earlier exact hit. Patterns naming a parameter (transformers' expert weights:
    `experts.gate_up_proj`) go to the second map."""
    out: dict[str, tuple[str, StyleSpec]] = {}
    param_styles: dict[str, str] = {}
    for pattern, style in plan.entries.items():
        _check_style_name(style, pattern, plan.source)
        hits = plans.names_matching(pattern, (n for n in modules if n))
        param_hits = plans.names_matching(pattern, params) if not hits else []
        if not hits and not param_hits and plan.strict:
            raise ConfigError(
                f"tensor-parallel plan ({plan.source}): pattern {pattern!r} matches no module of "
                f"{next(iter(modules.values())).__class__.__name__}; names look like: "
                f"{', '.join(list(n for n in modules if n)[:8])}, ..."
            )
        for name in hits:
            out.setdefault(name, (pattern, style))
        for name in param_hits:
            if not reg.fact(style, "on_parameters"):
                raise ConfigError(
                    f"tensor-parallel plan ({plan.source}): {pattern!r} names parameter {name!r} with "
                    f"style {style!r}; parameter entries take {', '.join(reg.EXPERT_PARAM_STYLES)} (expert "
                    "weights under a 'moe_tp_experts' module; 'colwise' for per-head parameters under a "
                    "'local_params' module); point other entries at modules"
                )
            param_styles.setdefault(name, style)
    return out, param_styles


def _check_module_type(name: str, module: nn.Module, style: StyleSpec, source: str) -> None:
    if not isinstance(style, str):
        return
    kind = reg.STYLES[style].applies_to
    if kind == reg.ANY:
        return
    if is_lora_layer(module):  # a PEFT LoRA layer is split as its base layer (lora.py)
        module = module.base_layer
    if kind == reg.EMBEDDING:
        ok, takes = isinstance(module, nn.Embedding), "nn.Embedding"
    else:
        ok = isinstance(module, nn.Linear) or is_conv1d(module) or (kind == reg.SPLITTABLE and isinstance(module, nn.Embedding))
        takes = "nn.Linear / Conv1D" + (" and nn.Embedding" if kind == reg.SPLITTABLE else "")
    if not ok:
        raise ConfigError(
            f"tensor-parallel plan ({source}): style {style!r} cannot split {name!r} "
            f"({type(module).__name__}); it applies to {takes}. Point the pattern at "
            "the projection layers inside the module, or pass a torch ParallelStyle object"
        )
    if not reg.STYLES[style].on_modules:
        raise ConfigError(
            f"tensor-parallel plan ({source}): {style!r} on module {name!r}; smp reads it "
            "on expert parameters only (under a 'moe_tp_experts' module). Use 'rowwise' for a Linear"
        )


def _check_local_params(m: Matched) -> None:
    """A `local_params` module runs on the local shards of its own parameters: each must be split
    by its own 'colwise' entry (by head, dim 0). One left whole would be read in full by every
    rank's share of the heads (a shape error, or worse a broadcast); refused, naming the entry."""
    for owner in sorted(m.styled_as(reg.LOCAL_PARAMS)):
        for pname, p in m.modules[owner].named_parameters(recurse=False):
            full = f"{owner}.{pname}"
            style = m.param_styles.get(full)
            if style is None and p.requires_grad:
                raise ConfigError(
                    f"tensor-parallel plan ({m.source}): {owner!r} has style 'local_params' but its parameter "
                    f"{full!r} {tuple(p.shape)} has no entry; add {full!r}: 'colwise' (one value per head, "
                    "split with the heads) or remove the 'local_params' entry"
                )
            if style is not None and style != reg.COLWISE:
                raise ConfigError(
                    f"tensor-parallel plan ({m.source}): {full!r} has style {style!r}; a parameter of a "
                    "'local_params' module takes 'colwise' (split on dim 0 with the heads)"
                )


def _check_param_owners(m: Matched) -> None:
    """A parameter entry is read only under a module styled to split per parameter."""
    owners = set(m.styled_as(reg.MOE_EXPERTS)) | set(m.styled_as(reg.LOCAL_PARAMS))
    for pname, style in m.param_styles.items():
        if pname.rpartition(".")[0] not in owners:
            raise ConfigError(
                f"tensor-parallel plan ({m.source}): parameter entry {pname!r} ({style!r}) needs its "
                f"module {pname.rpartition('.')[0]!r} styled 'moe_tp_experts' (expert weights) or "
                "'local_params' (per-head parameters such as attention sinks). Add that entry, or "
                "remove the parameter's"
            )


def in_width(module: nn.Module) -> int | None:
    """A Linear / Conv1D layer's input width."""
    if is_conv1d(module):
        return module.weight.shape[0]
    return getattr(module, "in_features", None)


def match(model: nn.Module, plan: TPPlan, anatomy: Anatomy | None = None) -> Matched:
    """What `plan` names in `model`, checked, with one assignment per named module (in plan
    order) and the regions those open. Raises ConfigError naming the entry and the fix.
    `anatomy`: the picture already taken of `model` (its head, embedding and decoder)."""
    anatomy = anatomy or describe(model)
    modules = dict(model.named_modules())
    entries, param_styles = _match_entries(plan, modules, [n for n, _ in model.named_parameters()])
    head = anatomy.head
    if head is None:  # a user model: its head is the entry styled "lm_head", if any
        head = next((n for n, (_, s) in entries.items() if s == reg.LM_HEAD), None)
    m = Matched(model, plan.source, modules, entries, param_styles, head, anatomy.embedding)
    m.sp_scope, m.sp_entry = _language_model(model, m.embedding, anatomy.decoder)
    _check_local_params(m)
    _check_param_owners(m)
    m.moe_blocks = {n.rpartition(".")[0]: modules[n.rpartition(".")[0]] for n in m.styled_as(reg.MOE_EXPERTS)}
    for name, (_, style) in entries.items():
        _check_module_type(name, modules[name], style, plan.source)
        parent = name.rpartition(".")[0]
        if name != head and reg.fact(style, "opens_region"):
            m.regions[parent] = modules[parent]
            m.widths.setdefault(parent, in_width(modules[name]))
        elif name != head and reg.fact(style, "gathered_region"):
            m.gathered[parent] = modules[parent]
            m.widths.setdefault(parent, in_width(modules[name]))
        own = {p.rpartition(".")[2]: s for p, s in param_styles.items() if p.rpartition(".")[0] == name}
        m.assignments.append(Assignment(name, modules[name], style, is_head=(name == head),
                                        sequence_parallel=m.runs_sequence_parallel(name), param_styles=own))
    # An MLA region's input width is what its `mla_kv_a_proj` layer reads: its first colwise layer
    # (`q_b_proj`) may read a latent instead.
    m.widths.update({n.rpartition(".")[0]: in_width(modules[n]) for n in m.styled_as(reg.MLA_KV_A)})
    return m
