"""Pipeline parallelism vs the single-process run: the split (in one process), then every torch
schedule at pp 2 on gloo, PP 2 x FSDP 2 at world 4, and the negative controls beside them.

Tolerances (fp32): the pipelined step runs the same ops on the same rows, only the loss is summed
per micro-batch, so losses agree to ~1e-6 and gradients to ~5e-8; we assert 1e-5 for both. The
negative controls move them by > 1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch

import smp
from smp.config import PIPELINE_SCHEDULES
from smp.pipeline import build_stage_module, check_layer_chain, find_parts, plan_split
from tests.pipeline import pipeline_cases as cases

LOSS_TOL, GRAD_TOL = 1e-5, 1e-5
PP2 = {"pipeline_parallel_degree": 2}


# ----------------------------------------------------------------------------------------------
# The split, in one process


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mixtral", "plain", "tied_llama"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_chained_equal_the_model_bitwise(kind, num_stages):
    torch.manual_seed(0)
    model = cases.tiny_model(kind)
    reference = copy.deepcopy(model)
    parts = find_parts(model)
    check_layer_chain(model, parts)
    stages = [build_stage_module(model, parts, info) for info in plan_split(model, num_stages)]
    ids = torch.randint(0, cases.VOCAB, (2, 16))
    x = ids
    for stage in stages:
        x = stage(x)
    want = reference(ids) if kind == "plain" else reference(input_ids=ids).logits
    assert torch.equal(x, want)
    # Every parameter on exactly one stage, under the whole model's name.
    names = [n for stage in stages for n in stage.state_dict()]
    assert sorted(names) == sorted(reference.state_dict()) and len(names) == len(set(names))


def test_split_reports_parameters_and_flops_per_stage():
    model = cases.tiny_model("llama", layers=8)
    split = plan_split(model, 4)
    assert [list(s.layers) for s in split][0][0] == 0 and split[-1].layers.stop == 8
    assert sum(s.params for s in split) == sum(p.numel() for p in model.parameters())
    assert split[0].first and split[-1].last
    text = split[0].describe()
    assert text.startswith("stage 0: embedding, layers 0-") and "parameters" in text and "FLOPs/token" in text
    # Balanced: no stage costs more than one layer's FLOPs above the mean.
    layer_flops = split[1].flops_per_token / len(split[1].layers)
    mean = sum(s.flops_per_token for s in split) / 4
    assert max(s.flops_per_token for s in split) <= mean + layer_flops


def test_explicit_split_and_too_few_layers():
    model = cases.tiny_model("llama")
    assert [list(s.layers) for s in plan_split(model, 2, [1])] == [[0], [1, 2, 3]]
    with pytest.raises(smp.ConfigError, match="4 layers, fewer than the 8 pipeline stages"):
        plan_split(model, 8)
    with pytest.raises(smp.ConfigError, match="names layer 4"):
        plan_split(model, 2, [4])


def test_split_works_on_meta():
    with torch.device("meta"):
        model = cases.tiny_model("llama")
    parts = find_parts(model)
    check_layer_chain(model, parts)  # runs on a parameter-free copy
    stage = build_stage_module(model, parts, plan_split(model, 2)[1])
    assert all(p.is_meta for p in stage.parameters())
    assert "model.embed_tokens.weight" not in stage.state_dict() and "lm_head.weight" in stage.state_dict()


def test_a_forward_that_is_not_a_chain_is_refused():
    """Negative control for the split: a long residual (the embedding added again before the
    head) would be dropped at a stage boundary; the chain check names where."""
    model = cases.tiny_model("skip")
    with pytest.raises(smp.ConfigError, match="norm does not receive layers.3's output unchanged"):
        check_layer_chain(model, find_parts(model))


# ----------------------------------------------------------------------------------------------
# pp 2 vs one process


def _assert_matches(reports):
    for report in reports:
        assert report["loss_diff"] < LOSS_TOL, report
        assert report["grad_diff"] < GRAD_TOL, report
    assert reports[0]["losses"][1] < reports[0]["losses"][0]  # it trains


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_every_schedule_matches_one_process(ranks, schedule):
    reports = ranks(2).run(cases.equivalence, config={**PP2, "pipeline": schedule})
    _assert_matches(reports)
    held = [set(r["names"]) for r in reports]
    assert not held[0] & held[1]  # each parameter on one rank
    assert held[0] | held[1] == {n for n, _ in cases.tiny_model("llama").named_parameters()}  # all of them


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
def test_every_schedule_matches_one_process_on_other_families(ranks, kind, schedule):
    # Qwen3 (q/k norms), Mixtral (MoE blocks); a tied-embedding family under every schedule:
    # tests/pipeline/test_pipeline_tied.py
    _assert_matches(ranks(2).run(cases.equivalence, config={**PP2, "pipeline": schedule}, kind=kind))


def test_a_plain_layer_list_model_matches_one_process(ranks):
    _assert_matches(ranks(2).run(cases.equivalence, config={**PP2, "pipeline": "1f1b"}, kind="plain"))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_inside_stages(ranks, mode):
    config = {**PP2, "pipeline": "1f1b", "activation_checkpointing": mode}
    _assert_matches(ranks(2).run(cases.equivalence, config=config))


def test_offloading_and_compile_inside_stages(ranks):
    # The rest of the recipe inside each stage, each shown to have acted.
    offload = {**PP2, "pipeline": "1f1b", "activation_checkpointing": "full", "activation_offloading": True,
               "activation_offload_min_bytes": 0}
    reports = ranks(2).run(cases.equivalence, config=offload)
    _assert_matches(reports)
    assert all(r["acted"]["offloaded_bytes"] > 0 for r in reports), [r["acted"] for r in reports]
    compiled = {**PP2, "pipeline": "1f1b", "compile": {"enabled": True, "backend": "aot_eager"}}
    reports = ranks(2).run(cases.equivalence, config=compiled)
    _assert_matches(reports)
    assert all(r["acted"]["compiled_blocks"] > 0 for r in reports), [r["acted"] for r in reports]


def test_more_microbatches_and_a_mean_loss_fn(ranks):
    config = {**PP2, "pipeline": {"schedule": "gpipe", "microbatches": 8}}
    _assert_matches(ranks(2).run(cases.equivalence, config=config, loss="mean"))


def test_clip_grad_norm_is_global_across_stages(ranks):
    reports = ranks(2).run(cases.equivalence, config={**PP2, "pipeline": "1f1b"}, clip=0.1)
    _assert_matches(reports)
    assert max(r["norm_diff"] for r in reports) < 1e-5


def test_unscaled_microbatch_loss_is_caught(ranks):
    """Negative control: a per-micro-batch mean not divided by the micro-batch count."""
    reports = ranks(2).run(cases.equivalence, config={**PP2, "pipeline": "1f1b"}, loss="unscaled", steps=1)
    assert max(r["grad_diff"] for r in reports) > 100 * GRAD_TOL


def test_dropped_residual_at_a_stage_boundary_is_caught(ranks):
    """Negative control: split the long-residual model anyway (chain check off); the
    comparison catches what the boundary drops. With the check on, every rank refuses it."""
    reports = ranks(2).run(cases.equivalence, config={**PP2, "pipeline": "gpipe"}, kind="skip",
                           skip_chain_check=True, steps=1)
    assert max(r["loss_diff"] for r in reports) > 100 * LOSS_TOL
    for message in ranks(2).run(cases.error_of_transform, config=PP2, kind="skip"):
        assert message.startswith("ConfigError: smp cannot split SkipTransformer"), message


def test_meta_model_initialises_bitwise_as_eager(ranks):
    assert ranks(2).run(cases.meta_equals_eager, config=PP2) == [0.0, 0.0]


def test_wrong_use_is_a_clear_error(ranks, tmp_path):
    config = {**PP2, "pipeline": {"microbatches": 2}}
    for called, odd_batch, saved in ranks(2).run(cases.call_errors, config=config, path=str(tmp_path / "ckpt")):
        assert called.startswith("UsageError") and "needs labels" in called and "smp.step" in called
        assert odd_batch == ""  # 3 rows in 2 micro-batches: padded with ignored rows (tests/training/test_step.py proves it)
        assert saved.startswith("UsageError") and "smp.checkpointing.load(path, model)" in saved


# ----------------------------------------------------------------------------------------------
# PP 2 x FSDP 2 (world 4)


@pytest.mark.parametrize("config", [
    {**PP2, "pipeline": "1f1b"},
    {**PP2, "pipeline": "interleaved_1f1b"},
    {**PP2, "pipeline": "gpipe", "hybrid_shard_degree": 1},
], ids=["1f1b-fsdp2", "interleaved-fsdp2", "gpipe-replicate2"])
def test_pp2_x_fsdp2_matches_one_process(ranks, config):
    _assert_matches(ranks(4).run(cases.equivalence, config=config))


def test_pp2_x_fsdp2_with_smp_gradient_sync(ranks):
    # smp's own ring reduce-scatter (kernels/) as each stage's FSDP gradient reduction
    reports = ranks(4).run(cases.equivalence, config={**PP2, "pipeline": "1f1b", "gradient_sync": "ring"})
    _assert_matches(reports)
    assert all(r["acted"]["sync_bytes"] for r in reports), [r["acted"] for r in reports]


def test_clip_grad_norm_pp2_x_fsdp2(ranks):
    reports = ranks(4).run(cases.equivalence, config={**PP2, "pipeline": "1f1b"}, clip=0.1, steps=1)
    for report in reports:
        assert report["norm_diff"] < 1e-5 and report["grad_diff"] < GRAD_TOL, report


def test_fsdp_inside_a_stage_gathers_once_per_step(ranks):
    """Under pp, FSDP units stay gathered from the first micro-batch's forward to the last one's
    backward (one all-gather per unit per step) and are resharded after the step; with
    reshard_after_forward: true set, they gather again per micro-batch."""
    for report in ranks(4).run(cases.all_gathers_per_step, config=PP2):
        assert report["per_step"] == report["units"] and report["resharded_after_step"], report
    for report in ranks(4).run(cases.all_gathers_per_step, config={**PP2, "reshard_after_forward": True}):
        assert report["per_step"] > 2 * report["units"], report


def test_split_backward_schedules_with_resharding_fsdp_are_refused():
    # Exact without resharding (tests/pipeline/test_pipeline_compose.py); refused when FSDP reshards.
    from smp.config import load_config
    from smp.mesh import ParallelDims

    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        config = {**PP2, "reshard_after_forward": True, "pipeline": {"schedule": schedule, "microbatches": 4}}
        with pytest.raises(smp.ConfigError, match="is not supported"):
            ParallelDims.from_config(load_config(config), 4)
