"""Pipeline parallelism as a user meets it: smp.state's pipeline coordinates, and the model
coverage matrix's pp 2 column (tests/models/model_coverage_pp_cases.py) on a family it splits, one it
refuses, and its negative control. (The example script under pp: tests/core/test_example.py; the
Trainer's refusal: tests/integrations/test_trainer.py.)"""

from __future__ import annotations

import pytest

from tests.models import model_coverage_cases as coverage
from tests.models import model_coverage_pp_cases as pp_cases
from tests.pipeline import pipeline_user_cases as cases


def test_state_reports_the_pipeline_stage(ranks):
    reports = ranks(2).run(cases.state_coordinates, config={"pipeline_parallel_degree": 2})
    assert [(r["rank"], r["pp_rank"], r["pp_size"]) for r in reports] == [(0, 0, 2), (1, 1, 2)]
    assert all((r["dp_rank"], r["dp_size"]) == (0, 1) for r in reports)  # both ranks feed the same rows
    reports = ranks(2).run(cases.state_coordinates, config={})  # no pipeline: one stage
    assert [(r["pp_rank"], r["pp_size"], r["dp_rank"]) for r in reports] == [(0, 1, 0), (0, 1, 1)]


def test_coverage_column_exact_and_refused(ranks):
    for result in ranks(2).run(pp_cases.classify, family="llama", **coverage.MODES["pp2"]):
        assert result["status"] == "exact", result
    for result in ranks(2).run(pp_cases.classify, family="gpt2", **coverage.MODES["pp2"]):
        assert result["status"] == "refused" and "GPT2LMHeadModel" in result["detail"], result


def test_coverage_column_catches_an_unscaled_microbatch_loss(ranks):
    """Negative control: a micro-batch loss not divided by the micro-batch count must read as a
    gap far above the tolerance, not exact."""
    for report in ranks(2).run(pp_cases.equivalence, family="llama", steps=1, drop_microbatch_scale=True,
                               **coverage.MODES["pp2"]):
        assert report["grad_diff"] > 100 * coverage.TOL, report


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (2, "interleaved_1f1b"), (4, "1f1b")],
                         ids=["1f1b", "interleaved", "1f1b-fsdp2"])
def test_evaluate_is_the_forward_loss_and_leaves_training_exact(ranks, world, schedule):
    """smp.pipeline.evaluate of right-padded rows between training steps equals the whole
    model's masked eval loss on the whole batch in one process (1e-5), also with 2 data-parallel
    ranks per stage; it writes no gradient, and the training steps around it stay exact."""
    config = {"pipeline_parallel_degree": 2, "pipeline": schedule}
    reports = ranks(world).run(cases.evaluate_vs_one_process, config=config)
    for r in reports:
        assert r["eval_diff"] < 1e-5 and r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r
        assert r["grads_after_eval"] == 0, r
        assert r["unmasked_diff"] > 1e-3, r  # the control: padding counted as targets is caught
    assert reports[0]["eval_losses"][1] != reports[0]["eval_losses"][0]  # the step between them changed the model
