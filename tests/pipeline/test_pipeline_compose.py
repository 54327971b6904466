"""Pipeline parallelism composed with the rest of smp, vs the single-process run: PP 2 x TP 2,
PP 2 x EP 2 (Mixtral), the zero-bubble / V schedules under FSDP, right-padded batches (under
FSDP, TP, EP and replicas), all at world 4; PP 2 x TP 2 x FSDP 2 at world 8 (slow); the
compositions smp refuses, with their reasons; a negative control beside each equivalence.

Tolerances (fp32): 1e-5 on the loss and on every gradient, as in tests/pipeline/test_pipeline.py
(measured: loss <= 1.5e-6, gradients <= 1e-7). The negative controls move them by > 1e-2.
"""

from __future__ import annotations

import pytest

import smp
from smp.config import load_config
from smp.mesh import ParallelDims
from tests.pipeline import pipeline_compose_cases as cases

LOSS_TOL, GRAD_TOL = 1e-5, 1e-5
PP2 = {"pipeline_parallel_degree": 2}
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def _assert_exact(reports, sharded_over=None):
    for report in reports:
        assert report["loss_diff"] < LOSS_TOL and report["grad_diff"] < GRAD_TOL, report
        if sharded_over is not None:
            assert sharded_over <= set(report["sharded_over"]), report
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]  # it trains


def _assert_caught(reports):
    assert max(r["grad_diff"] for r in reports) > 1000 * GRAD_TOL, reports


# ----------------------------------------------------------------------------------------------
# PP 2 x TP 2 (world 4), PP 2 x TP 2 x FSDP 2 (world 8)


@pytest.mark.parametrize("schedule, padded", [("1f1b", False), ("interleaved_1f1b", True)],
                         ids=["1f1b", "interleaved-padded"])
def test_pp2_x_tp2_matches_one_process(ranks, schedule, padded):
    config = {**PP2, "tensor_parallel_degree": 2, "pipeline": {"schedule": schedule, "microbatches": 4}}
    _assert_exact(ranks(4).run(cases.compose, config=config, padded=padded), sharded_over={"tp"})


def test_tp_group_fed_different_rows_is_caught(ranks):
    """Negative control: the two TP ranks of a stage given different rows."""
    config = {**PP2, "tensor_parallel_degree": 2, "pipeline": "1f1b"}
    _assert_caught(ranks(4).run(cases.compose, config=config, broken="tp_rows", steps=1))


@pytest.mark.slow
def test_pp2_x_tp2_x_fsdp2_matches_one_process(ranks):
    config = {**PP2, "tensor_parallel_degree": 2, "pipeline": "1f1b"}
    reports = ranks(8).run(cases.compose, config=config, layers=2, steps=1)
    for report in reports:  # one step: the loss and every gradient
        assert report["loss_diff"] < LOSS_TOL and report["grad_diff"] < GRAD_TOL, report
        assert {"tp", "dp_shard_cp"} <= set(report["sharded_over"]), report  # FSDP's view: dp_shard x cp (cp 1)


@pytest.mark.parametrize("key", ["sequence_parallel", "loss_parallel"])
def test_tp_options_that_do_not_compose_are_refused(key):
    with pytest.raises(smp.ConfigError, match=f"tensor_parallel.{key}: true with pipeline_parallel_degree=2"):
        load_config({**PP2, "tensor_parallel_degree": 2, "tensor_parallel": {key: True}})


# ----------------------------------------------------------------------------------------------
# PP 2 x EP 2 (Mixtral, world 4) and the router's load-balancing loss


def test_pp2_x_ep2_mixtral_matches_one_process(ranks):
    config = {**PP2, "expert_parallel_degree": 2, "pipeline": {"schedule": "1f1b", "microbatches": 4}}
    reports = ranks(4).run(cases.compose, config=config, kind="mixtral", padded=True)
    _assert_exact(reports, sharded_over={"ep"})


def test_load_balancing_loss_across_stages_is_refused(ranks):
    with pytest.raises(smp.ConfigError, match="moe_load_balancing 'aux_loss' with pipeline_parallel_degree=2"):
        load_config({**PP2, "moe": {"moe_load_balancing": "aux_loss"}})
    # The model's own switch, on every rank, before any collective of the step.
    config = {**PP2, "expert_parallel_degree": 2, "pipeline": "1f1b"}
    for message in ranks(4).run(cases.transform_error, config=config, kind="mixtral",
                                model_config={"output_router_logits": True}):
        assert message.startswith("ConfigError: MixtralForCausalLM adds a load-balancing loss"), message


# ----------------------------------------------------------------------------------------------
# Split-backward (zero-bubble, V) schedules under FSDP


@pytest.mark.parametrize("schedule, replicate", [(s, False) for s in SPLIT_BACKWARD] + [("zbv_zero_bubble", True)],
                         ids=[*SPLIT_BACKWARD, "zbv-replicate2-padded"])
def test_split_backward_schedules_x_fsdp2_match_one_process(ranks, schedule, replicate):
    config = {**PP2, "pipeline": {"schedule": schedule, "microbatches": 4}}
    if replicate:  # HSDP with 2 replicas of 1 shard; padded rows: the replicas hold different target counts
        config["hybrid_shard_degree"] = 1
    _assert_exact(ranks(4).run(cases.compose, config=config, padded=replicate))


def test_split_backward_with_resharding_is_caught_and_refused(ranks):
    """Negative control: resharding after forward loses weight gradients that the schedule
    computes after a later micro-batch's forward; the config check refuses it."""
    config = {**PP2, "reshard_after_forward": True,
              "pipeline": {"schedule": "interleaved_zero_bubble", "microbatches": 4}}
    _assert_caught(ranks(4).run(cases.compose, config=config, broken="resharded", steps=1))
    for schedule in SPLIT_BACKWARD:
        config["pipeline"]["schedule"] = schedule
        with pytest.raises(smp.ConfigError, match="resharded the parameters they belong to"):
            ParallelDims.from_config(load_config(config), 4)
    ParallelDims.from_config(load_config(config), 2)  # one rank per stage: no FSDP, accepted


# ----------------------------------------------------------------------------------------------
# Padding: labels of -100 and attention masks


def test_padded_batch_matches_one_process(ranks):
    """Right-padded rows of different lengths: micro-batches and data-parallel ranks hold
    different target counts; the loss is still the mean over the whole batch's targets."""
    config = {**PP2, "pipeline": {"schedule": "1f1b", "microbatches": 4}}
    _assert_exact(ranks(4).run(cases.compose, config=config, padded=True))


def test_per_microbatch_mean_on_padded_rows_is_caught(ranks):
    """Negative control: a per-micro-batch mean, averaged, weighs a short row's targets more."""
    config = {**PP2, "pipeline": {"schedule": "1f1b", "microbatches": 4}}
    _assert_caught(ranks(4).run(cases.compose, config=config, padded=True, broken="microbatch_mean", steps=1))


def test_padding_the_step_cannot_run_exactly_is_refused(ranks):
    for left, on_padding in ranks(4).run(cases.step_errors, config={**PP2, "pipeline": "gpipe"}):
        assert left.startswith("UsageError") and "right-padded rows only" in left, left
        assert on_padding.startswith("UsageError") and "must be -100" in on_padding, on_padding


# ----------------------------------------------------------------------------------------------
# Context parallel


def test_pp_x_cp_beyond_what_is_proven_is_refused_with_the_reason():
    # PP x CP alone is proven in tests/pipeline/test_pipeline_cp.py; with TP beside it, refused.
    with pytest.raises(smp.ConfigError) as e:
        load_config({**PP2, "context_parallel_degree": 2, "tensor_parallel_degree": 2})
    message = str(e.value)
    assert "pipeline_parallel_degree=2" in message and "context_parallel_degree=2" in message
    assert "proven pipeline x context parallel alone only" in message
