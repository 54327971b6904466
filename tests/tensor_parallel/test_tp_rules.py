"""The tensor-parallel plan rules (smp/tensor_parallel/rules.py), the style registry and the plan
tables (smp/plans.py), one process, no mesh.

Each rule has one test on the family whose quirk it encodes, and its negative control: the same
expansion with that rule left out must lose what the rule adds (an assignment, or a refusal), so
the test would catch a rule that stopped firing. The equivalence of what the rules produce with
one process is proven by the multi-rank TP tests (test_tensor_parallel.py, test_tp_*.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from smp import plans
from smp.errors import ConfigError, Error
from smp.expert_parallel.plan import SMP_TABLES as EP_TABLES
from smp.expert_parallel.plan import resolve_ep_plan
from smp.tensor_parallel import SMP_TABLES, STYLE_NAMES, registry, rules, tp_plan
from smp.tensor_parallel.registry import Options
from smp.tensor_parallel.tp_plan import Assignment, resolve_plan
from smp.testing.models import tiny_llama
from tests.models import model_coverage_cases as coverage
from tests.tensor_parallel import tp_cases, tp_local_params_cases, tp_mla_cases, tp_vlm_cases, tp_vocabulary_cases

SP, NO_SP = Options(sequence_parallel=True), Options()


@dataclass
class Case:
    rule: rules.Rule
    build: Callable[[], nn.Module]
    opts: Options
    # What the rule adds: module name -> (style, a substring of its `why`); or a refusal's text.
    adds: dict[str, tuple[str, str]] = field(default_factory=dict)
    refuses: str = ""
    plan: Callable[[], dict | None] = lambda: None


def _llama_without_head_entry() -> dict:
    return {k: v for k, v in tiny_llama()._tp_plan.items() if k != "lm_head"}


def _tied_llama() -> nn.Module:
    return tiny_llama(tie_word_embeddings=True)


def _llama_with_embedding_extra() -> nn.Module:
    model = tiny_llama()
    model.model.embed_tokens.eoi_embedding = nn.Parameter(torch.zeros(model.config.hidden_size))
    return model


def _plan_without_embedding() -> dict:
    return {k: v for k, v in tiny_llama()._tp_plan.items() if k != "model.embed_tokens"}


CASES = [
    # GPT-2, Gemma, Llama 3.2 1B: a split head splits the embedding it shares its weight with.
    Case(rules.tie_embedding_to_head, _tied_llama, NO_SP, plan=_plan_without_embedding,
         adds={"model.embed_tokens": ("embedding_rowwise", "")}),
    # Attention sinks split with heads that no projection splits: refused.
    Case(rules.local_params_need_split_heads, lambda: tp_local_params_cases.build("granite_swa"), NO_SP,
         refuses="no projection inside it is split",
         plan=lambda: tp_local_params_cases.own_plan("granite_swa", drop=("_proj",))),
    # MiniCPM3's MLA: q_a_proj reads the unsplit input, the latent norms precede colwise layers.
    Case(rules.mla_whole_input, lambda: tp_mla_cases.build("minicpm3"), NO_SP, adds={
        "model.layers.0.self_attn.q_a_proj": ("replicate", "reads the MLA region's unsplit input"),
        "model.layers.0.self_attn.kv_a_layernorm": ("replicate", "norm of an MLA latent"),
    }),
    # HY-V4's top-k indexer runs under @torch.no_grad(): its parameters stay whole.
    Case(rules.gradless_submodules, lambda: tp_vocabulary_cases.build("hy_v4"), NO_SP, adds={
        "model.layers.0.self_attn.indexer.k_norm": ("replicate", "runs its forward under torch.no_grad"),
    }),
    # Qwen3's per-head q_norm / k_norm, with the shipped plan's entries for them removed.
    Case(rules.per_head_parameters, lambda: tp_vocabulary_cases.build("qwen3"), NO_SP,
         plan=lambda: tp_vocabulary_cases.plan_for("qwen3", "stripped"), adds={
             "model.layers.0.self_attn.q_norm": ("replicated_with_grad_allreduce", "per-head parameter"),
         }),
    Case(rules.shared_region_entry, tiny_llama, NO_SP, adds={"model.layers.0.self_attn": ("region_entry", "")}),
    # LLaVA embeds the tokens and scatters the image features in before its language model.
    Case(rules.sp_enter_at_language_model, lambda: tp_vlm_cases.build("llava"), SP,
         adds={"model.language_model": ("shard_sequence", "inputs_embeds")}),
    Case(rules.sp_gather_at_region_entry, tiny_llama, SP, adds={"model.layers.1.mlp": ("gather_sequence", "")}),
    # Qwen3-MoE's MoE block: router and experts on the gathered sequence.
    Case(rules.sp_moe_block_takes_whole_sequence, lambda: tp_vocabulary_cases.build("qwen3_moe"), SP,
         adds={"model.layers.0.mlp": ("whole_sequence", "")}),
    # DeepSeek-V3's attention, left whole beside its split MLP.
    Case(rules.sp_whole_sequence_siblings, lambda: tp_vocabulary_cases.build("deepseek_v3"), SP,
         adds={"model.layers.0.self_attn": ("whole_sequence", "")}),
    Case(rules.sp_norms_on_shards, tiny_llama, SP, adds={"model.norm": ("sequence_parallel", ""),
                                                          "model.layers.0.input_layernorm": ("sequence_parallel", "")}),
    # GPT-2's position embedding, added to the sequence-sharded token embedding.
    Case(rules.sp_embeddings_join_shards, lambda: tp_cases.build("gpt2"), SP,
         adds={"transformer.wpe": ("replicate_to_sequence", "")}),
    # HRM's bare `z_L_init` parameter on the model, added to the stream.
    Case(rules.sp_replicate_other_params, lambda: coverage.build_family("hrm_text"), SP,
         adds={"model": ("replicate_params", "")}),
    Case(rules.sp_needs_the_head, tiny_llama, SP, plan=_llama_without_head_entry,
         refuses="sequence_parallel needs the output head"),
    # T5Gemma2: its scaled embedding owns `eoi_embedding` besides its weight.
    Case(rules.embedding_owns_only_its_weight, _llama_with_embedding_extra, NO_SP,
         refuses="owns 'eoi_embedding')"),
    # Qwen3-VL / Cosmos3-Omni: no text plan, only the head split.
    Case(rules.sp_needs_split_layers, tiny_llama, SP, plan=lambda: {"lm_head": "colwise_gather_output"},
         refuses="sequence_parallel: the tensor-parallel plan splits no layer"),
    # ViT, DINOv2, CLIP, SigLIP, Whisper: no language-model token stream to shard.
    Case(rules.sp_token_streams_only, lambda: tp_vlm_cases.build("vit"), SP,
         refuses="sequence_parallel: ViTForImageClassification is a vision"),
]


def _expand(case: Case, without_rule: bool = False) -> dict[str, Assignment] | str:
    """name -> assignment, or the refusal's message."""
    torch.manual_seed(0)
    model = case.build()
    plan = resolve_plan(model, case.plan(), None)
    chosen = tuple(r for r in rules.RULES if not (without_rule and r is case.rule))
    try:
        return {a.name: a for a in rules.expand_plan(model, plan, case.opts, rules=chosen).assignments}
    except Error as e:
        return str(e)


def _holds(case: Case, result: dict[str, Assignment] | str) -> bool:
    if case.refuses:
        return isinstance(result, str) and case.refuses in result
    if isinstance(result, str):
        return False
    return all(name in result and result[name].style == style and why in result[name].why
               for name, (style, why) in case.adds.items())


def test_every_rule_has_a_case():
    assert {c.rule for c in CASES} == set(rules.RULES)


@pytest.mark.parametrize("case", CASES, ids=[c.rule.__name__ for c in CASES])
def test_rule(case):
    result = _expand(case)
    assert _holds(case, result), result if isinstance(result, str) else {
        n: (result[n].style, result[n].why) if n in result else None for n in case.adds}


@pytest.mark.parametrize("case", CASES, ids=[c.rule.__name__ for c in CASES])
def test_rule_negative_control(case):
    """Without the rule the expansion differs exactly where the test looks."""
    assert not _holds(case, _expand(case, without_rule=True))


def test_rules_do_not_fire_on_a_plain_decoder():
    """Llama without sequence parallel: the plan's entries and one shared entry per region, nothing
    else (no per-head, MLA or gradless additions)."""
    model = tiny_llama()
    expanded = rules.expand_plan(model, resolve_plan(model, None, None), NO_SP)
    added = {a.style for a in expanded.assignments if a.name not in expanded.entries}
    assert added == {"region_entry"}, added


def test_sequence_parallel_stays_in_the_language_model(monkeypatch):
    """LLaVA under sequence parallel: its vision tower (split by smp's CLIP table) runs as without
    sequence parallel, the projector is left alone and the embedding's output stays whole.
    Negative control: with the whole model as the scope (as before), the vision tower's norms
    and patch conv join the stream (its crash: `got mixed torch.Tensor and DTensor` in the
    convolution)."""
    def expand() -> dict[str, Assignment]:
        model = tp_vlm_cases.build("llava")
        return {a.name: a for a in rules.expand_plan(model, resolve_plan(model, None, None), SP).assignments}

    def on_the_stream(assigned: dict[str, Assignment]) -> list[str]:
        return [n for n, a in assigned.items() if n.startswith(("model.vision_tower", "model.multi_modal_projector"))
                and (a.sequence_parallel or a.style not in ("colwise", "rowwise", "region_entry"))]

    assigned = expand()
    assert "model.vision_tower.encoder.layers.0.mlp.fc1" in assigned
    assert on_the_stream(assigned) == [] and not assigned["model.language_model.embed_tokens"].sequence_parallel
    monkeypatch.setattr(tp_plan, "_language_model", lambda model, embedding, decoder: ("", None))
    assigned = expand()
    assert "model.vision_tower.encoder.layers.0.layer_norm1" in on_the_stream(assigned)
    assert assigned["model.language_model.embed_tokens"].sequence_parallel


def test_nested_tables_complete_the_models_own_plan():
    """LLaVA's own plan covers its language model; smp's CLIP table splits its vision tower.
    Negative control: a user plan is taken as written (no vision-tower entries added)."""
    model = tp_vlm_cases.build("llava")
    plan = resolve_plan(model, None, None)
    assert plan.entries["model.vision_tower.encoder.layers.*.self_attn.q_proj"] == "colwise"
    assert "smp's table for model.vision_tower (model_type 'clip_vision_model')" in plan.source
    user = {k: v for k, v in model._tp_plan.items()}
    assert resolve_plan(model, user, None).entries == user


# --- the style registry -------------------------------------------------------------------------

def test_registry_names_and_facts():
    assert set(STYLE_NAMES) | set(registry.REFUSED_STYLES) == set(registry.STYLES)
    assert all(registry.STYLES[n].build is not None for n in STYLE_NAMES if registry.STYLES[n].on_modules)
    assert all(reason for reason in registry.REFUSED_STYLES.values())
    regions = {n for n, s in registry.STYLES.items() if s.opens_region}
    assert regions == {"colwise", "packed_colwise", "packed_qkv_colwise"}
    assert {n for n, s in registry.STYLES.items() if s.gathered_region} == {"colwise_rep", "colwise_gather_output"}
    assert {n for n, s in registry.STYLES.items() if s.closes_region} == {"rowwise", "rowwise_rep", "rowwise_split_input"}
    assert set(registry.EXPERT_PARAM_STYLES) == {"colwise", "rowwise", "packed_colwise", "packed_rowwise"}


def test_registry_covers_transformers_styles():
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES) <= set(registry.STYLES), set(ALL_PARALLEL_STYLES) - set(registry.STYLES)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_registry_builds_every_module_style(sequence_parallel):
    """Each name applied to modules builds a ParallelStyle (or nothing, for 'replicate')."""
    model = tiny_llama()
    opts = Options(sequence_parallel=sequence_parallel)
    linear, emb = model.model.layers[0].mlp.up_proj, model.model.embed_tokens
    for name in STYLE_NAMES:
        info = registry.STYLES[name]
        if not info.on_modules or name in ("moe_tp_experts", "local_params", "mla_kv_a_proj"):
            continue  # need their own module kinds: covered by the TP family tests
        module = emb if info.applies_to == registry.EMBEDDING else linear
        built = registry.build_style(Assignment("m", module, name), opts, model)
        assert (built is None) == info.replicated and (built is None or isinstance(built, ParallelStyle)), name


# --- the plan tables: matching, base prefixes, precedence ----------------------------------------

def test_pattern_matches_one_component_per_star():
    assert plans.matches("layers.*.mlp", "layers.3.mlp")
    assert not plans.matches("layers.*.mlp", "layers.3.block.mlp")  # one component only
    assert not plans.matches("layers.*.mlp", "layers.3.mlp.up")  # the whole name
    assert not plans.matches("a.b", "aXb")  # dots are literal
    assert plans.value_of({"x.*": 1, "x.y": 2}, "x.y") == 1  # the first pattern wins
    assert plans.names_matching("h.*.attn", ["h.0.attn", "h.0.mlp", "h.1.attn"]) == ["h.0.attn", "h.1.attn"]


def test_base_prefix():
    llama = tiny_llama()
    assert plans.base_prefix(llama) == "model."
    assert plans.base_prefix(llama.model) == ""
    assert plans.under_base(llama, {"layers.*.mlp": "x"}) == {"model.layers.*.mlp": "x"}


def test_tp_precedence_user_config_model_table():
    llama, gpt2 = tiny_llama(), tp_cases.build("gpt2")
    user, config = {"model.layers.*.mlp.up_proj": "colwise"}, {"model.layers.*.mlp.down_proj": "rowwise"}
    assert resolve_plan(llama, user, config).entries == user
    assert resolve_plan(llama, None, config).entries == config
    assert resolve_plan(llama, None, None).source == "LlamaForCausalLM's own transformers plan"
    table = resolve_plan(gpt2, None, None)
    assert table.source == "smp's table for model_type 'gpt2'" and not table.strict
    assert table.entries["transformer.h.*.attn.c_attn"] == "packed_qkv_colwise"  # under the base prefix
    assert table.entries["lm_head"] == "colwise_gather_output"  # the head, added by smp
    assert resolve_plan(llama, user, None).strict
    # Negative control: a model with no plan anywhere is refused, naming the table's families.
    with pytest.raises(ConfigError, match="has no tensor-parallel plan"):
        resolve_plan(tp_cases.build("user"), None, None)


def test_ep_precedence_config_model_table(monkeypatch):
    mixtral = tp_vocabulary_cases.build("mixtral")
    assert resolve_ep_plan(mixtral, {"x": "ep_dispatch_experts"}).entries == {"x": "ep_dispatch_experts"}
    own = resolve_ep_plan(mixtral, None)
    assert own.source == "MixtralForCausalLM's own transformers plan"
    assert all(k.startswith("model.layers.") for k in own.entries)
    llama = tiny_llama()
    assert resolve_ep_plan(llama, None).entries == {}  # a dense model: no plan
    monkeypatch.setitem(EP_TABLES, "llama", {"layers.*.mlp.experts": "ep_dispatch_experts"})
    table = resolve_ep_plan(llama, None)
    assert table.source == "smp's table for model_type 'llama'"
    assert table.entries == {"model.layers.*.mlp.experts": "ep_dispatch_experts"}


def test_tables_are_written_relative_to_the_base_model():
    for tables in (SMP_TABLES, EP_TABLES):
        for model_type, table in tables.items():
            assert not any(k.startswith("model.") for k in table), model_type
