"""`smp.step` / `smp.evaluate`: one training loop for every layout, each equal to one process.

The loop (tests/training/step_cases.equivalence) is the same for every config: this rank's data-parallel
rows of a right-padded global batch (the data-parallel ranks and micro-batches hold different
target counts) -> smp.step -> SGD, and smp.evaluate on held-out rows; the tiny Llama (2 layers,
hidden 64, GQA) or Mixtral (4 experts, with or without its load-balancing loss) vs the same
loop in one process.

Tolerances (fp32): 1e-5 on every rank's loss, on every gradient and on the evaluation loss.
Negative controls: each rank's loss normalised by its own rows' target count (FSDP 2, EP 2),
rows cut for context parallel without the load-balanced layout (CP 2), the rows that pad a
ragged pipeline batch keeping their targets (PP 2), a MoE load-balancing loss from each rank's
own router statistics (FSDP 2, EP 2, EP 2 x FSDP 2); each caught.
"""

from __future__ import annotations

import pytest

from smp import composition
from tests.training import step_cases as cases

TOL = 1e-5
FSDP2 = {}
TP2_SP = {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True}}
CP2 = {"context_parallel_degree": 2}
PP2 = {"pipeline_parallel_degree": 2, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
EP2 = {"expert_parallel_degree": 2}
PP2_TP2 = {**PP2, "tensor_parallel_degree": 2}
PP2_CP2 = {**PP2, "context_parallel_degree": 2}


def _assert_matches(reports: list[dict]) -> None:
    for report in reports:
        assert report["loss_diff"] < TOL and report["grad_diff"] < TOL and report["eval_diff"] < TOL, report
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]  # it trains


@pytest.mark.parametrize("config", [FSDP2, TP2_SP, CP2, PP2], ids=["fsdp2", "tp2-sp-loss_parallel", "cp2", "pp2"])
def test_one_loop_matches_one_process(ranks, config):
    _assert_matches(ranks(2).run(cases.equivalence, config=config))


@pytest.mark.parametrize("schedule", ["zbv_zero_bubble", "dualpipev"])
def test_v_schedules_step_and_evaluate_match_one_process(ranks, schedule):
    """The V schedules hold two adjacent stages per rank (one layer each: 4 layers at PP 2), and
    torch's eval() still runs their backward actions: smp.evaluate used to assert in the hand-off
    of input gradients between the two stages (and leave the other rank waiting)."""
    config = {"pipeline_parallel_degree": 2, "pipeline": {"schedule": schedule, "microbatches": 4}}
    _assert_matches(ranks(2).run(cases.equivalence, config=config, layers=4))


@pytest.mark.parametrize("config", [FSDP2, CP2], ids=["fsdp2", "cp2"])
def test_a_loss_fn_over_num_items_in_batch_matches_one_process(ranks, config):
    """loss_fn(outputs, batch) dividing its token sum by batch["num_items_in_batch"]."""
    _assert_matches(ranks(2).run(cases.equivalence, config=config, loss_fn="token_sum"))


def test_a_plain_module_matches_one_process(ranks):
    """A user's nn.Module (logits out): smp.step scores its logits itself."""
    _assert_matches(ranks(2).run(cases.equivalence, config=FSDP2, kind="plain"))


@pytest.mark.slow
def test_expert_parallel_matches_one_process(ranks):
    _assert_matches(ranks(2).run(cases.equivalence, config=EP2, kind="mixtral"))


@pytest.mark.slow
@pytest.mark.parametrize("config", [PP2_TP2, PP2_CP2], ids=["pp2xtp2", "pp2xcp2"])
def test_pipeline_compositions_match_one_process(ranks, config):
    _assert_matches(ranks(4).run(cases.equivalence, config=config))


@pytest.mark.parametrize("config, broken", [
    (FSDP2, "per_rank_count"), (CP2, "cut_without_load_balance"),
], ids=["fsdp2-per-rank-count", "cp2-unbalanced-cut"])
def test_negative_controls_are_caught(ranks, config, broken):
    reports = ranks(2).run(cases.equivalence, config=config, broken=broken, steps=1)
    assert max(r["grad_diff"] for r in reports) > 100 * TOL, reports


@pytest.mark.slow
def test_expert_parallel_negative_control_is_caught(ranks):
    reports = ranks(2).run(cases.equivalence, config=EP2, kind="mixtral", broken="per_rank_count", steps=1)
    assert max(r["grad_diff"] for r in reports) > 100 * TOL, reports


# Mixtral with its load-balancing loss (output_router_logits=True, coefficient 0.1; the term is
# ~2.0) through smp.step vs one process, 2 SGD steps on the padded batch. Measured (loss /
# gradients / evaluation): FSDP 2 0 / 2.6e-8 / 4.8e-7, EP 2 0 / 3.0e-8 / 4.8e-7, EP 2 x FSDP 2
# 4.8e-7 / 3.7e-8 / 1.4e-6. Negative control, each rank's own router statistics (not summed over
# the data-parallel ranks): 1.2e-4 / 2.2e-3 at FSDP 2 and EP 2, 2.4e-3 / 1.0e-2 at EP 2 x FSDP 2.
# World 2 cases take under a second once the pool is warm; world 4 about 10 s with its start.
ROUTER_LOSS = [
    pytest.param(2, FSDP2, id="fsdp2"),
    pytest.param(2, EP2, id="ep2"),
    pytest.param(4, EP2, id="ep2xfsdp2"),
]


@pytest.mark.parametrize("world, config", ROUTER_LOSS)
def test_router_loss_matches_one_process(ranks, world, config):
    """The load-balancing loss is a product of two means over the whole batch: smp.transform sums
    its router statistics over the data-parallel ranks, so smp.step's loss (with the term) and
    every gradient are the one-process ones."""
    reports = ranks(world).run(cases.equivalence, config=config, kind="mixtral", router_loss=True, timeout=300)
    _assert_matches(reports)
    assert min(reports[0]["aux"]) > 0.5, reports  # the term is there: num_experts x sum f x P is ~1 or more


@pytest.mark.parametrize("world, config", ROUTER_LOSS)
def test_router_loss_from_each_rank_alone_is_caught(ranks, world, config):
    reports = ranks(world).run(cases.equivalence, config=config, kind="mixtral", router_loss=True,
                               broken="per_rank_router_statistics", steps=1, timeout=300)
    assert max(r["loss_diff"] for r in reports) > 10 * TOL and max(r["grad_diff"] for r in reports) > 100 * TOL, reports


@pytest.mark.parametrize("world, config", [
    (2, FSDP2), (2, PP2), pytest.param(4, PP2, marks=pytest.mark.slow),
], ids=["fsdp2", "pp2", "pp2xfsdp2"])
def test_accumulation(ranks, world, config):
    for report in ranks(world).run(cases.accumulation, config=config):
        assert report["grad_diff"] < TOL and report["no_sync_grad_diff"] < TOL, report


def test_pipelined_model_called_like_the_whole_model(ranks):
    """model(**batch) + loss.backward() and no_grad evaluation, as an accelerate loop does."""
    for report in ranks(2).run(cases.pipelined_call, config=PP2):
        assert report["loss_diff"] < TOL and report["grad_diff"] < TOL and report["eval_diff"] < TOL, report
        assert report["ragged_diff"] < TOL, report
        errors = report["errors"]
        assert errors["no_labels"].startswith("UsageError") and "needs labels" in errors["no_labels"], errors
        assert errors["twice"].startswith("UsageError") and "called twice" in errors["twice"], errors
        assert errors["scaled"].startswith("UsageError") and "weight 0.5" in errors["scaled"], errors


def test_ragged_pipeline_batch_padding_is_checked(ranks):
    """Negative control: padding rows that keep their targets change the loss."""
    reports = ranks(2).run(cases.ragged_eval, config=PP2, broken="pad_with_targets")
    assert min(r["ragged_diff"] for r in reports) > 100 * TOL, reports


def test_what_cannot_be_exact_is_refused_on_every_rank(ranks):
    for errors in ranks(2).run(cases.step_errors, config=FSDP2, kind="mixtral", router_loss="before"):
        assert errors["plain"] == "", errors  # the router loss trains at FSDP 2 (above)
        not_summed = errors["not_summed"]
        assert not_summed.startswith("UsageError") and "output_router_logits=True" in not_summed, errors
        assert "2 data-parallel ranks" in not_summed and "global_load_balancing_loss" in not_summed, errors
    # Context parallel splits each row's tokens: refused with the composition table's reason and fix.
    cp_row = composition.row("aux_loss", "cp")
    for errors in ranks(2).run(cases.step_errors, config=CP2, kind="mixtral", router_loss="after"):
        plain = errors["plain"]
        assert plain.startswith("ConfigError") and "context_parallel_degree=2" in plain, errors
        assert cp_row.reason in plain and "moe_load_balancing: none" in plain, errors
    # Pipeline parallelism: transform refuses the switch; turned on after it, the step refuses it.
    pp_row = composition.row("aux_loss", "pp")
    for errors in ranks(2).run(cases.step_errors, config=PP2, kind="mixtral", router_loss="after"):
        plain = errors["plain"]
        assert plain.startswith("ConfigError") and "set after smp.transform" in plain, errors
        assert pp_row.reason in plain, errors
    for errors in ranks(2).run(cases.step_errors, config=PP2):
        assert errors["plain"] == "", errors
        assert "token_type_ids" in errors["unknown_key"] and "leave them out" in errors["unknown_key"], errors
        # packed rows train under the pipeline (tests/training/test_packed_sequences.py), not with this batch's mask
        packed_with_mask = "packed rows (position_ids restart inside a row) and an attention_mask"
        assert packed_with_mask in errors["packed_positions"], errors


@pytest.mark.parametrize("use_cache,exact", [(None, True), (True, False)])
def test_packed_rows_through_a_forward_taking_use_cache_by_kwargs(ranks, use_cache, exact):
    """GraniteMoE's forward takes use_cache only through **kwargs: smp.step still switches the
    cache off, so packed documents stay apart (before: loss 1.1e-2 off). Negative control: the
    batch asking for the cache attends across the documents."""
    (report,) = ranks(1).run(cases.packed_step_vs_documents, family="granitemoe", use_cache=use_cache)
    within = report["loss"] <= 1e-5 and report["grads"] <= 1e-5
    assert within == exact, report
