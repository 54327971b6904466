"""Tensor parallel on the model families users bring, vs the single-process run.

Each family runs its own transformers plan (GPT-J: a user plan) at TP=2 and TP=2 with sequence
parallel; loss and every gradient must match one process within 1e-5 over 3 SGD steps (seen:
loss <= 5e-7, gradients <= 5e-7). The negative control breaks the one sync these families add
(per-head norms' gradient sum) and must be caught (~5e-3).

Covered: Qwen3 and Gemma3 (per-head q_norm/k_norm: `replicated_with_grad_allreduce`, and the
same plan with those entries removed), Qwen3-MoE / Qwen2-MoE / Mixtral / DeepSeek-V3
(`moe_tp_experts` on 3-D expert weights; DeepSeek-V3's MLA attention stays replicated), Phi-3
and OLMo2 (`colwise_gather_output` / `rowwise_split_input` regions), GPT-J (head counts read
from attributes), and the model's own `labels=` loss under loss parallel without any context.
"""

from __future__ import annotations

import pytest

from tests.tensor_parallel import tp_vocabulary_cases as cases

TOL = 1e-5
TP2 = {"tensor_parallel_degree": 2}
TP2_SP = {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}
FAMILIES = ["qwen3", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "phi3", "olmo2", "gptj"]
MATRIX = [(k, c, n) for k in FAMILIES for c, n in ((TP2, "tp2"), (TP2_SP, "tp2-sp"))]


def _check(reports: list[dict]) -> None:
    for report in reports:
        assert report["sharded"] > 0, report
    cases.assert_matches_one_process(reports, TOL)


@pytest.mark.parametrize("kind,config,name", MATRIX, ids=[f"{m[0]}-{m[2]}" for m in MATRIX])
def test_family_matches_single_process(ranks, kind, config, name):
    _check(ranks(2).run(cases.equivalence, config=config, kind=kind, timeout=300))


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_per_head_norms_synced_without_their_plan_entries(ranks, kind):
    """The shipped plan minus its `replicated_with_grad_allreduce` entries, as a user plan: smp
    finds the per-head norms inside the split attention and sums their gradients itself."""
    reports = ranks(2).run(cases.equivalence, config=TP2, kind=kind, plan="stripped")
    _check(reports)
    applied = reports[0]["tp_plan"]["model.layers.0.self_attn.q_norm"]
    assert applied.startswith("replicated_with_grad_allreduce (auto: per-head parameter"), applied


def test_no_grad_indexer_stays_whole(ranks):
    """HY-V4's top-k indexer sits inside the split attention, but its forward runs under
    `torch.no_grad`: its parameters get no gradient, so smp replicates them (the peer does too)."""
    reports = ranks(2).run(cases.equivalence, config=TP2, kind="hy_v4", timeout=300)
    _check(reports)
    applied = reports[0]["tp_plan"]["model.layers.0.self_attn.indexer.wq_b"]
    assert applied.startswith("replicate (auto: 'model.layers.0.self_attn.indexer' runs its forward under torch.no_grad"), applied


def test_indexer_with_gradients_is_refused(ranks):
    """Negative control: the same indexer without its no_grad (its gradients would be partial)."""
    for message in ranks(2).run(cases.indexer_with_gradients_error, config=TP2):
        assert message.startswith("PlanError") and "self_attn.indexer" in message, message


@pytest.mark.parametrize("plan", ["own", "stripped"])
def test_unsynced_norm_gradients_are_caught(ranks, plan):
    """Negative control: with the sum broken, the norm gradients are off by ~5e-3 (loss ~1e-5)."""
    reports = ranks(2).run(cases.equivalence, config=TP2, kind="qwen3", plan=plan, break_sync=True)
    diffs = reports[0]["grad_diffs"]
    assert diffs["model.layers.0.self_attn.q_norm.weight"] > 100 * TOL, diffs
    assert reports[0]["grad_diff"] > 100 * TOL


@pytest.mark.parametrize("kind,config", [("qwen3", TP2), ("qwen2_moe", TP2_SP)], ids=["qwen3", "qwen2_moe-sp"])
def test_model_labels_loss_under_loss_parallel_needs_no_context(ranks, kind, config):
    """`model(input_ids, labels=).loss` and its backward outside `loss_parallel()` on vocab-sharded
    logits (what examples/finetune_causal_lm.py does)."""
    config = {**config, "tensor_parallel": {**config.get("tensor_parallel", {}), "loss_parallel": True}}
    _check(ranks(2).run(cases.equivalence, config=config, kind=kind, loss_context=False))


@pytest.mark.parametrize("plan", ["own", "stripped"])
def test_gpt_oss_expert_biases(ranks, plan):
    """GPT-OSS experts ([experts, in, out], gate/up interleaved) with their biases: the gate_up
    bias split like its weight's output, the down bias added once. 'stripped': the plan names
    no bias, each follows its weight."""
    reports = ranks(2).run(cases.equivalence, config=TP2, kind="gpt_oss", plan=plan, timeout=300)
    _check(reports)
    diffs = reports[0]["grad_diffs"]
    assert max(diffs["model.layers.0.mlp.experts.down_proj_bias"], diffs["model.layers.0.mlp.experts.gate_up_proj_bias"]) < TOL


def test_gpt_oss_down_bias_added_on_every_rank_is_caught(ranks):
    """Negative control: each rank adds the down bias to its partial output, the sum holds it twice."""
    report = ranks(2).run(cases.equivalence, config=TP2, kind="gpt_oss", break_bias_once=True, timeout=300)[0]
    assert report["loss_diff"] > 100 * TOL, report["loss_diff"]
    assert report["grad_diffs"]["model.layers.0.mlp.experts.down_proj_bias"] > 100 * TOL, report["grad_diffs"]


def test_expert_bias_split_unlike_its_weight_is_refused(ranks):
    plan = dict(cases.GPT_OSS_PLAN, **{"model.layers.*.mlp.experts.gate_up_proj_bias": "rowwise"})
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="gpt_oss", plan=plan):
        assert message.startswith("PlanError") and "gate_up_proj_bias is 'rowwise'" in message, message
        assert "give it the weight's style" in message, message


def test_gptj_head_count_is_per_rank(ranks):
    attrs = ranks(2).run(cases.region_attrs, config=TP2)[0]
    assert attrs == {"num_attention_heads": 2, "head_dim": 16, "config_heads": 4}, attrs


# ----------------------------------------------------------------------------- refusals


def test_expert_parallel_styles_are_refused_with_the_fix(ranks):
    plan = dict(cases.GPTJ_PLAN, **{"transformer.h.*.mlp.fc_in": "grouped_gemm"})
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="gptj", plan=plan):
        assert "style 'grouped_gemm'" in message and "expert parallelism" in message, message
        assert "moe_tp_experts" in message


def test_unclassifiable_replicated_parameter_is_refused(ranks):
    """A replicated parameter inside a split region that is not per-head (here MLA's
    q_a_layernorm, applied before the split): smp names it and the two explicit entries."""
    plan = {"model.layers.*.self_attn.q_b_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.self_attn.kv_b_proj": "colwise"}
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="deepseek_v3", plan=plan):
        assert message.startswith("PlanError"), message
        assert "self_attn.q_a_proj.weight" in message or "q_a_layernorm.weight" in message, message
        assert "'replicated_with_grad_allreduce'" in message and "'replicate'" in message


def test_parameter_entry_without_experts_module_is_refused(ranks):
    plan = dict(cases.GPTJ_PLAN, **{"transformer.h.*.attn.q_proj.weight": "rowwise"})
    plan.pop("transformer.h.*.attn.q_proj")
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="gptj", plan=plan):
        assert "needs its module 'transformer.h.0.attn.q_proj' styled 'moe_tp_experts'" in message, message


@pytest.mark.parametrize("kind,config,plan", [
    ("qwen3", TP2, "stripped"),
    ("mixtral", {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True}}, "own"),
], ids=["qwen3-stripped", "mixtral-sp-lossparallel"])
def test_composes_with_fsdp(ranks, kind, config, plan):
    """TP=2 x FSDP shard 2 (world 4): FSDP sums the per-head norms' Partial gradients and shards
    the split 3-D expert weights further."""
    _check(ranks(4).run(cases.equivalence, config=config, kind=kind, plan=plan, timeout=300))
