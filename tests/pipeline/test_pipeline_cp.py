"""Pipeline parallelism x context parallelism vs the single-process run: PP 2 x CP 2 at world 4
on a tiny Llama (2 layers, hidden 64, GQA, rotary), 16-token rows cut into 4 load-balanced
chunks; 1F1B and GPipe, whole and right-padded rows. smp.pipeline.step cuts each row for the cp
rank once, hands every stage the chunks' global position ids and the last stage targets shifted
over the whole row; the loss divides by the whole global batch's target count.

Tolerances (fp32): 1e-5 on the loss and on every gradient (measured over 2 SGD steps: loss
<= 4.8e-7, gradients <= 3.2e-8). Negative controls: positions counted from 0 on each stage's
chunk (what a stage computes when not told where its chunk sits: gradients off by 6.6e-4, loss
by 4e-5; the tiny model's rotary term is small) and labels shifted inside each chunk (loss off by
0.37, gradients by 3.6e-2); both caught.
"""

from __future__ import annotations

import pytest

import smp
from smp.config import load_config
from tests.pipeline import pipeline_cp_cases as cases

LOSS_TOL, GRAD_TOL = 1e-5, 1e-5
PP2_CP2 = {"pipeline_parallel_degree": 2, "context_parallel_degree": 2}


@pytest.mark.parametrize("schedule, padded", [("1f1b", False), ("gpipe", True)], ids=["1f1b", "gpipe-padded"])
def test_pp2_x_cp2_matches_one_process(ranks, schedule, padded):
    config = {**PP2_CP2, "pipeline": {"schedule": schedule, "microbatches": 4}}
    reports = ranks(4).run(cases.pp_x_cp, config=config, padded=padded)
    for report in reports:
        assert report["loss_diff"] < LOSS_TOL and report["grad_diff"] < GRAD_TOL, report
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]  # it trains


@pytest.mark.parametrize("broken", ["local_positions", "shift_inside_chunks"])
def test_chunks_without_their_place_in_the_row_are_caught(ranks, broken):
    """Negative controls: each stage's positions left local, or labels shifted inside the chunk."""
    config = {**PP2_CP2, "pipeline": "1f1b"}
    reports = ranks(4).run(cases.pp_x_cp, config=config, broken=broken, steps=1)
    assert max(r["grad_diff"] for r in reports) > 10 * GRAD_TOL, reports


def test_step_refusals_under_cp(ranks):
    config = {**PP2_CP2, "pipeline": "1f1b"}
    errors = ranks(4).run(cases.step_error, config=config, seq=10)
    assert all("does not split into 2 x context_parallel_degree = 4 chunks" in e for e in errors), errors
    errors = ranks(4).run(cases.step_error, config=config, loss_fn=True)
    assert all(e.startswith("UsageError") and "loss_fn with context_parallel_degree=2" in e for e in errors), errors
    # evaluate cuts the rows for the cp ranks as step does (tests/training/test_step.py: equal to one process)
    assert ranks(4).run(cases.step_error, config=config, evaluate=True) == [""] * 4


@pytest.mark.parametrize("extra, match", [
    ({"pipeline": "interleaved_1f1b"}, "pipeline schedule 'interleaved_1f1b' is not supported"),
    ({"tensor_parallel_degree": 2}, "tensor_parallel_degree=2 is not supported"),
    ({"expert_parallel_degree": 2}, "expert_parallel_degree=2 with context_parallel_degree=2 is not supported"),
])
def test_unproven_compositions_are_refused(extra, match):
    with pytest.raises(smp.ConfigError, match=match):
        load_config({**PP2_CP2, **extra})
