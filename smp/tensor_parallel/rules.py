"""What a tensor-parallel plan implies beyond its entries: one small rule per fact.

`expand_plan` matches a plan to a model (tp_plan.py), then runs `RULES` in order. Each rule reads
what the plan names and what earlier rules added (`Matched`), and returns the assignments it adds
(with a `why` when smp chose a style the plan did not name, shown in `model._smp_tp_plan`), or
raises a ConfigError / PlanError naming the module and the fix where smp cannot prove the result
equals one process. A family whose code steps outside what the rules know gets a new rule here
(and its test in tests/tensor_parallel/test_tp_rules.py), not a branch in `expand_plan`: docs/tensor-parallel.md,
"Adding a rule".
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from smp.anatomy import Anatomy, is_norm
from smp.errors import ConfigError, PlanError
from smp.tensor_parallel import registry as reg
from smp.tensor_parallel.lora import is_lora_layer
from smp.tensor_parallel.registry import Options
from smp.tensor_parallel.tp_plan import Assignment, Matched, TPPlan, in_width, match

Rule = Callable[[Matched, Options], list[Assignment]]


# --- what the rules read off modules ---------------------------------------------------------

def is_inline(region: nn.Module, width: int | None) -> bool:
    """A region that also holds the residual stream's norms (attention and MLP computed inline in
    the block, like TinyTransformer's): a norm as wide as the region's input."""
    return any(
        is_norm(m) and getattr(m, "weight", None) is not None and m.weight.shape[-1] == width
        for m in region.modules()
    )


def head_dim(model: nn.Module, region: nn.Module) -> int | None:
    cfg = reg.text_config(model)
    for owner in (region, cfg):
        dim = getattr(owner, "head_dim", None) or getattr(owner, "head_size", None)
        if isinstance(dim, int):
            return dim
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    return hidden // heads if heads and hidden else None


def mla_regions(m: Matched) -> set[str]:
    """Attention modules holding an `mla_kv_a_proj` layer (DeepSeek-V2-style latent attention)."""
    return {n.rpartition(".")[0] for n in m.styled_as(reg.MLA_KV_A)}


def runs_without_grad(module: nn.Module) -> bool:
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


def _full(rname: str, sub: str) -> str:
    return f"{rname}.{sub}" if rname and sub else (rname or sub)


def _covered(name: str, names: set[str]) -> bool:
    """`name` is one of `names` or inside one of them."""
    return any(n == name or name.startswith(n + ".") for n in names)


def _whole_in_regions(m: Matched) -> Iterator[tuple[str, nn.Module, str, str, nn.Module, list]]:
    """(region name, region, sub-path, module name, module, its parameters not split by a
    parameter entry) for each module inside a split region that owns such parameters and that
    neither the plan nor an earlier rule styles (a `local_params` module is split only in its
    named parameters: its submodules, such as per-head norms, still count). Frozen parameters
    count too, a whole per-head parameter meeting this rank's share of the heads in forward
    whether or not it trains (Doge's per-KV-head `A` under LoRA, its base frozen), except a
    frozen single value (Apertus' xIELU `alpha_p`): it acts alike on any share and gets no
    gradient to be partial."""
    styled = {a.name for a in m.assignments if a.style != reg.LOCAL_PARAMS}
    for rname in sorted(m.regions):
        for sub, module in m.regions[rname].named_modules():
            name = _full(rname, sub)
            own = [(n, p) for n, p in module.named_parameters(recurse=False)
                   if (p.requires_grad or p.numel() > 1) and f"{name}.{n}" not in m.param_styles]
            if own and not _covered(name, styled):
                yield rname, m.regions[rname], sub, name, module, own


# --- the rules, in the order they run ----------------------------------------------------------

def embedding_owns_only_its_weight(m: Matched, opts: Options) -> list[Assignment]:
    """A split embedding's forward runs whole under the style's hooks, its output a partial or
    sharded DTensor until the hook's end: a parameter the module owns besides `weight` and mixes
    into that output (T5Gemma2's `eoi_embedding`, written over the end-of-image positions) meets
    it as a plain tensor (torch's "got mixed torch.Tensor and DTensor" in `index_put`). Refused,
    naming the parameter, before any change."""
    owners, tied = [], []
    head = m.modules.get(m.head) if m.head else None
    for name, (_, style) in sorted(m.entries.items()):
        module = m.modules[name]
        if reg.fact(style, "applies_to") != reg.EMBEDDING:
            continue
        extra = [p for p, t in module.named_parameters(recurse=False) if p != "weight" and t.requires_grad]
        if extra:
            owners.append(f"{name!r} ({type(module).__name__}, style {style!r}, owns "
                          f"{', '.join(repr(p) for p in extra)})")
            tied += [m.head] if head is not None and getattr(head, "weight", None) is module.weight else []
    if owners:
        also = f" and without {sorted(set(tied))[0]!r}'s (its weight is tied to them)" if tied else ""
        raise PlanError(
            f"tensor-parallel plan: {'; '.join(owners)}: parameters besides the embedding's weight, which "
            "its forward mixes into the split embedding's output; smp cannot split that. Pass a plan "
            f"without these entries{also} (the embeddings then stay whole on every rank), or set "
            "tensor_parallel_degree: 1"
        )
    return []


def tie_embedding_to_head(m: Matched, opts: Options) -> list[Assignment]:
    """A tied head and input embedding share one weight: both must be split the same way (vocab
    rows: a colwise head is a row-wise embedding), so a split head brings the embedding (GPT-2,
    Gemma, Llama 3.2 1B)."""
    head, emb = m.head, m.embedding
    if head not in m.entries or not emb or emb in m.entries:
        return []
    if m.modules[head].weight is not m.modules[emb].weight:
        return []
    m.entries[emb] = ("<tied to the head>", reg.EMBEDDING_ROWWISE)
    return [Assignment(emb, m.modules[emb], reg.EMBEDDING_ROWWISE, sequence_parallel=m.runs_sequence_parallel(emb))]


def local_params_need_split_heads(m: Matched, opts: Options) -> list[Assignment]:
    """A `local_params` module (attention sinks) splits its per-head parameters with its heads:
    refused when none of its projections splits the heads."""
    whole_heads = sorted(set(m.styled_as(reg.LOCAL_PARAMS)) - set(m.regions))
    if whole_heads:
        raise ConfigError(
            f"tensor-parallel plan ({m.source}): {whole_heads[0]!r} has style 'local_params' but no projection "
            "inside it is split ('colwise'), so its heads stay whole and its split per-head parameters "
            "would not match them; split its q/k/v projections too, or remove the 'local_params' entry "
            "and its parameters'"
        )
    return []


def mla_whole_input(m: Matched, opts: Options) -> list[Assignment]:
    """The modules an MLA region's plan leaves whole that compute before the head split
    (DeepSeek-V2/V3, MiniCPM3): a Linear reading the region's input (`q_a_proj`) and a norm over
    a latent that a colwise up-projection reads (`q_a_layernorm`, `kv_a_layernorm`). Such a
    region has no shared entry, so its inputs stay plain tensors and every colwise layer sums its
    own input gradient: these modules' gradients are then whole on every rank and need no sync
    ('replicate'). A norm as wide as a latent and as a head (it could be either) is refused, as
    are the rest by `per_head_parameters`."""
    extras: list[Assignment] = []
    plan_styled = {n for n, (_, s) in m.entries.items() if s != reg.LOCAL_PARAMS}
    for rname in sorted(mla_regions(m)):
        if rname not in m.regions:
            raise ConfigError(
                f"tensor-parallel plan ({m.source}): {rname!r} holds an 'mla_kv_a_proj' layer but none of "
                "its projections is split ('colwise'), so its rotary key gradient is already whole and "
                "summing it would double it; split its q / kv_b projections too, or remove the entry"
            )
        region, hdim = m.regions[rname], head_dim(m.model, m.regions[rname])
        latents = {in_width(m.modules[n]) for n, (_, style) in m.entries.items()
                   if reg.fact(style, "opens_region") and n.rpartition(".")[0] == rname}
        whole: set[str] = set()
        for sub, module in region.named_modules():
            name = _full(rname, sub)
            # A LoRA layer counts as its base layer, its adapters with it (whole beside it, their
            # gradient as whole as the base's: lora.py); frozen parameters count, as in
            # `_whole_in_regions`.
            lora = is_lora_layer(module)
            layer = module.base_layer if lora else module
            own = [p for p in module.parameters(recurse=lora) if p.requires_grad or p.numel() > 1]
            if not own or _covered(name, plan_styled | whole):
                continue
            if isinstance(layer, nn.Linear) and layer.in_features == m.widths.get(rname):
                why = "auto: reads the MLA region's unsplit input"
            elif all(p.ndim == 1 and p.shape[0] in latents for p in own) and is_norm(module):
                if hdim in {p.shape[0] for p in own}:
                    raise PlanError(
                        f"tensor-parallel plan: {name!r} in the MLA region {rname!r} is as wide as both a "
                        f"latent and a head ({hdim}), so smp cannot tell whether its gradient is whole "
                        f"or partial; say which in the plan: {name!r}: 'replicate' (a latent norm) or "
                        "'replicated_with_grad_allreduce' (a per-head norm)"
                    )
                why = "auto: norm of an MLA latent before its colwise up-projection"
            else:
                continue
            extras.append(Assignment(name, module, reg.REPLICATE, why=why))
            whole.add(name)
    return extras


def _gradless_owner(region: nn.Module, rname: str, sub: str) -> str | None:
    """The module, from `region.<sub>` up to (not including) the region, whose forward runs
    without gradients; None when there is none."""
    parts = sub.split(".") if sub else []
    for depth in range(len(parts), 0, -1):
        path = ".".join(parts[:depth])
        if runs_without_grad(region.get_submodule(path)):
            return _full(rname, path)
    return None


def gradless_submodules(m: Matched, opts: Options) -> list[Assignment]:
    """Parameters inside a split region under a module whose forward runs under
    `@torch.no_grad()` (DeepSeek-V3.2 / HY-V4's top-k indexer) get no gradient, so their whole
    values are exact on every rank: 'replicate'."""
    extras = []
    for rname, region, sub, name, module, _ in _whole_in_regions(m):
        gradless = _gradless_owner(region, rname, sub)
        if gradless is not None:
            extras.append(Assignment(name, module, reg.REPLICATE, why=(
                f"auto: {gradless!r} runs its forward under torch.no_grad, so these parameters "
                "get no gradient to be partial")))
    return extras


def per_head_parameters(m: Matched, opts: Options) -> list[Assignment]:
    """Replicated parameters inside a split region whose gradient each rank computes only partly.

    Between a colwise layer and its rowwise partner every rank holds only its heads/features: a
    parameter applied there (Qwen3's per-head q_norm/k_norm) is whole on every rank, yet each
    rank's gradient covers only its own heads. Left alone, training silently diverges from one
    process (norm gradients off by ~1e-3), so smp sums them over the TP group automatically,
    exactly like transformers' `replicated_with_grad_allreduce` (which the shipped plans name).
    What smp cannot prove per-rank is refused, naming the parameter and the two explicit entries.
    """
    extras: list[Assignment] = []
    for rname, region, _sub, name, module, own in _whole_in_regions(m):
        width = m.widths.get(rname)
        if all(p.shape[-1] == width for _, p in own) and is_inline(region, width):
            continue  # a residual-stream norm of an inline block: it sees the whole input
        if all(p.ndim == 1 and p.shape[0] == head_dim(m.model, region) for _, p in own):
            extras.append(Assignment(name, module, reg.PARTIAL_GRAD,
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


def shared_region_entry(m: Matched, opts: Options) -> list[Assignment]:
    """Without sequence parallel: one shared replicated input per region, so backward all-reduces
    its gradient once, not once per projection. Not for regions that also hold norms (attention
    inline in the block): their input feeds the residual too, which must stay a plain tensor; nor
    for MLA regions, whose whole modules (q_a_proj, latent norms) compute on plain tensors."""
    if opts.sequence_parallel:
        return []
    return [
        Assignment(rname, region, reg.REGION_ENTRY)
        for rname, region in sorted(m.regions.items())
        if rname and not is_inline(region, m.widths.get(rname)) and rname not in mla_regions(m)
    ]


# Under sequence parallel the residual stream between regions is sharded on the sequence; the
# rules below say where it is gathered and what runs on the shards. They act inside the language
# model only (`Matched.sp_scope`): a vision tower, an audio encoder or a projector beside it runs
# on whole activations, its split regions as without sequence parallel.

def sp_token_streams_only(m: Matched, opts: Options) -> list[Assignment]:
    """Sequence parallel shards the token sequence of a language model (a causal LM, or the
    language model inside LLaVA / Qwen2.5-VL / Gemma3 / PaliGemma). A vision encoder without one
    (ViT, DINOv2, CLIP, SigLIP: the sequence is its patches, read by a classifier or pooler
    off one position) and an encoder-decoder speech model (Whisper: audio frames in its encoder,
    attention computed inline in its decoder layers) are refused, naming the model, before any
    change to it."""
    if not opts.sequence_parallel:
        return []
    import inspect

    try:
        takes = set(inspect.signature(m.model.forward).parameters)
    except (TypeError, ValueError):
        return []
    config = getattr(m.model, "config", None)
    name = type(m.model).__name__
    if "input_features" in takes and getattr(config, "is_encoder_decoder", False):
        why = (f"{name} is a speech encoder-decoder: its encoder's sequence is audio frames and its "
               "decoder layers compute attention inline (norms and split projections in one module)")
    elif "pixel_values" in takes and m.head is None:
        why = (f"{name} is a vision (or contrastive image-text) model without a language-model head: its "
               "sequences (image patches; a contrastive model's text too) are read off one position by a "
               "classifier or pooler")
    else:
        return []
    raise ConfigError(
        f"sequence_parallel: {why}. smp shards the token sequence of a language model only (a causal LM, "
        "or the language model inside a VLM such as LLaVA, Qwen2.5-VL, Gemma3 or PaliGemma). Set "
        f"tensor_parallel.sequence_parallel: false: tensor parallel alone is exact on {name}"
    )


def sp_needs_split_layers(m: Matched, opts: Options) -> list[Assignment]:
    """Sequence parallel shards the stream between split regions: a plan that splits no layer
    of the language model (Qwen3-VL's text config ships no `base_model_tp_plan`, so only the
    head is split) leaves every layer's whole weights to meet the sequence shards (torch's
    "got mixed torch.Tensor and DTensor" in its first projection). Refused before any change."""
    if not opts.sequence_parallel or _bounded(m):
        return []
    scope = m.sp_scope or type(m.model).__name__
    raise ConfigError(
        f"sequence_parallel: the tensor-parallel plan splits no layer of {scope!r} "
        f"({type(m.model).__name__}; the plan names only {sorted(m.entries) or 'nothing'}), so the "
        "sequence-sharded stream would meet whole weights in every layer. Add the language model's "
        "attention and MLP projections to the plan (colwise / rowwise entries, as a causal LM's "
        "`base_model_tp_plan` has them), or set tensor_parallel.sequence_parallel: false"
    )


def sp_enter_at_language_model(m: Matched, opts: Options) -> list[Assignment]:
    """A multimodal model (LLaVA, Qwen2.5-VL, Gemma3, ...) embeds the tokens and scatters the
    image features in before it calls its language model with `inputs_embeds`: the sequence is
    sharded there, and the embedding's output stays whole (`Matched.runs_sequence_parallel`)."""
    if not opts.sequence_parallel or m.sp_entry is None:
        return []
    return [Assignment(m.sp_entry, m.modules[m.sp_entry], reg.SHARD_SEQUENCE,
                       why="auto: the multimodal model hands the language model its inputs_embeds here")]



def sp_gather_at_region_entry(m: Matched, opts: Options) -> list[Assignment]:
    """Each region gathers the sequence at its entry: a region in an MoE block (DeepSeek-V3's
    shared experts) is already gathered; an MLA region's whole modules compute on plain tensors."""
    if not opts.sequence_parallel:
        return []
    closing: dict[str, int] = {}
    for name, (_, style) in m.entries.items():
        if reg.fact(style, "closes_region"):
            closing[name.rpartition(".")[0]] = closing.get(name.rpartition(".")[0], 0) + 1
    extras = []
    for rname, region in sorted({**m.regions, **m.gathered}.items()):
        # A region holding the block's own norms (attention computed inline in the block) has no
        # place for the sequence gather between norm and projections. A gathered region's norms
        # see whole activations (OLMo2's q_norm), so there only a second closing layer (attention
        # and MLP in one module) tells.
        inline = is_inline(region, m.widths.get(rname)) if rname in m.regions else closing.get(rname, 0) > 1
        if inline:
            raise ConfigError(
                f"sequence_parallel: {rname or type(m.model).__name__!r} holds both norm layers and "
                "the split projections, so smp cannot gather the sequence between them; put "
                "attention and MLP in their own submodules, or set tensor_parallel.sequence_parallel: false"
            )
        if m.in_moe_block(rname) or not m.in_sp_scope(rname):  # gathered already, or off the stream
            extras.append(Assignment(rname, region, reg.REGION_ENTRY, sequence_parallel=False))
        elif rname in mla_regions(m):
            extras.append(Assignment(rname, region, reg.WHOLE_SEQUENCE))
        else:
            extras.append(Assignment(rname, region, reg.GATHER_SEQUENCE))
    return extras


def sp_moe_block_takes_whole_sequence(m: Matched, opts: Options) -> list[Assignment]:
    """An MoE block (router, experts, unsplit shared expert) gathers the sequence and hands a
    shard back."""
    if not opts.sequence_parallel:
        return []
    extras = []
    for bname, block in sorted(m.moe_blocks.items()):
        if not m.in_sp_scope(bname):
            continue  # runs on whole activations, like everything outside the language model
        if bname in m.regions or bname in m.gathered or not bname:
            raise ConfigError(
                f"sequence_parallel: {bname or type(m.model).__name__!r} holds both the MoE experts and "
                "split projections, so smp has no single place to gather the sequence; set "
                "tensor_parallel.sequence_parallel: false"
            )
        extras.append(Assignment(bname, block, reg.WHOLE_SEQUENCE))
    return extras


def _bounded(m: Matched) -> list[str]:
    """Modules that take the whole sequence in: regions, MoE blocks, whole-sequence blocks."""
    names = [r for r in (*m.regions, *m.gathered, *m.moe_blocks) if r and m.in_sp_scope(r)]
    added = [a.name for a in m.assignments if a.style == reg.WHOLE_SEQUENCE and a.name not in m.entries]
    return names + [n for n in added if n not in names]


def sp_whole_sequence_siblings(m: Matched, opts: Options) -> list[Assignment]:
    """A sibling of a region that the plan leaves whole (DeepSeek-V3's attention beside its split
    MLP) computes on plain tensors: it takes the whole sequence and hands a shard back. Every
    layer of a stack holding such a block is one too: AFMoE's dense first layer, whose plan
    splits nothing, sits in the same `layers` list as its MoE layers."""
    if not opts.sequence_parallel:
        return []
    bounded = _bounded(m)
    blocks = {r.rpartition(".")[0] for r in bounded}
    stacks = {b.rpartition(".")[0] for b in blocks if isinstance(m.modules.get(b.rpartition(".")[0]), nn.ModuleList)}
    blocks |= {n for n in m.modules if n and n.rpartition(".")[0] in stacks}
    extras = []
    for name, module in m.modules.items():
        if name.rpartition(".")[0] not in blocks or name in bounded or is_norm(module) or name in m.entries:
            continue
        if not m.in_sp_scope(name):
            continue
        if any(name.startswith(b + ".") for b in bounded):
            continue  # inside a region or MoE block: it already runs on the whole sequence
        if any(n.startswith(name + ".") for n in m.entries) or isinstance(module, nn.Embedding):
            continue
        if any(p.requires_grad for p in module.parameters()):
            extras.append(Assignment(name, module, reg.WHOLE_SEQUENCE))
            bounded.append(name)
    return extras


def _outside(bounded: list[str], name: str) -> bool:
    return not any(name.startswith(r + ".") for r in bounded)


def sp_norms_on_shards(m: Matched, opts: Options) -> list[Assignment]:
    """Norms outside every region run on the sequence shard (Megatron's sequence parallel)."""
    if not opts.sequence_parallel:
        return []
    bounded = _bounded(m)
    return [Assignment(name, module, reg.SEQUENCE_PARALLEL) for name, module in m.modules.items()
            if is_norm(module) and name not in m.entries and _outside(bounded, name) and m.in_sp_scope(name)]


def sp_embeddings_join_shards(m: Matched, opts: Options) -> list[Assignment]:
    """An embedding the plan leaves whole outside every region (GPT-2's position embedding),
    added to the sequence-sharded token embedding: its output joins the stream as a shard (not
    the input embedding of a wrapped language model: its output stays whole until the entry)."""
    if not opts.sequence_parallel:
        return []
    bounded = _bounded(m)
    return [Assignment(name, module, reg.REPLICATE_TO_SEQUENCE) for name, module in m.modules.items()
            if isinstance(module, nn.Embedding) and name not in m.entries and _outside(bounded, name)
            and m.in_sp_scope(name) and not (m.sp_entry is not None and name == m.embedding)]


def sp_replicate_other_params(m: Matched, opts: Options) -> list[Assignment]:
    """Anything else owning parameters meets the sequence-sharded stream at the model level
    (HRM's z_L_init, DeepSeek-V4's hc_head): its parameters join it as Replicate DTensors."""
    if not opts.sequence_parallel:
        return []
    styled = {*_bounded(m), *m.entries, *m.assigned()}
    return [Assignment(name, module, reg.REPLICATE_PARAMS) for name, module in m.modules.items()
            if not _covered(name, styled) and m.in_sp_scope(name)
            and next(module.parameters(recurse=False), None) is not None]


def sp_needs_the_head(m: Matched, opts: Options) -> list[Assignment]:
    """The output head gathers the sequence back: sequence parallel needs it in the plan."""
    if opts.sequence_parallel and (m.head is None or m.head not in m.entries):
        raise ConfigError(
            "sequence_parallel needs the output head in the tensor-parallel plan (style "
            "'colwise_gather_output' or 'lm_head'), so that it gathers the sequence; add it, or set "
            "tensor_parallel.sequence_parallel: false"
        )
    return []


RULES: tuple[Rule, ...] = (
    embedding_owns_only_its_weight,
    tie_embedding_to_head,
    local_params_need_split_heads,
    mla_whole_input,
    gradless_submodules,
    per_head_parameters,
    shared_region_entry,
    sp_token_streams_only,
    sp_needs_split_layers,
    sp_enter_at_language_model,
    sp_gather_at_region_entry,
    sp_moe_block_takes_whole_sequence,
    sp_whole_sequence_siblings,
    sp_norms_on_shards,
    sp_embeddings_join_shards,
    sp_replicate_other_params,
    sp_needs_the_head,
)


def expand_plan(model: nn.Module, plan: TPPlan, opts: Options, rules: tuple[Rule, ...] = RULES,
                anatomy: Anatomy | None = None) -> Matched:
    """`plan`'s assignments in `model` (tp_plan.match), then what each rule adds, in order."""
    m = match(model, plan, anatomy)
    for rule in rules:
        m.assignments += rule(m, opts)
    return m
