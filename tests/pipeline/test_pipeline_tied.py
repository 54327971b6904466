"""Tied embeddings (the LM head is the input embedding) across pipeline stages vs one process.

Each stage holding a copy keeps its own; the step sums the copies' gradients. Proven on a tied
Llama and Gemma at pp 2 under 1F1B and GPipe, interleaved 1F1B and a V schedule (2 stages per
rank; the V puts the embedding and the head on one rank), PP 2 x FSDP 2 and PP 2 x TP 2: loss and every
gradient (both names of the tied tensor included) within 1e-5 of one process over 3 AdamW
steps, the copies bitwise equal after them (and equal to the reference within the tolerance),
clip_grad_norm_ counting the tied tensor once. Negative control: the gradient sum skipped.
Copies laid out differently on the two ranks are refused on every rank.
"""

from __future__ import annotations

import pytest

from smp.config import PIPELINE_SCHEDULES
from tests.pipeline import pipeline_tied_cases as cases

LOSS_TOL, GRAD_TOL = 1e-5, 1e-5
PP2 = {"pipeline_parallel_degree": 2}


def _assert_exact(reports):
    for r in reports:
        assert r["loss_diff"] < LOSS_TOL, r
        assert r["grad_diff"] < GRAD_TOL, r
    digests = {}
    for r in reports:
        for name, digest in r["digests"].items():
            digests.setdefault(digest, []).append(name)
    # Every copy on every rank holds the same bits after the optimizer steps.
    assert len(digests) == 1, digests
    assert set(cases.TIED) <= {n for r in reports for n in r["tied_names"]}


@pytest.mark.parametrize("kind,schedule", [
    *(("tied_llama", schedule) for schedule in PIPELINE_SCHEDULES),  # the multi-stage ones at 2 per rank
    ("gemma", "1f1b"),
    ("gemma", {"schedule": "zbv_zero_bubble", "stages_per_rank": 2}),
])
def test_tied_embeddings_match_one_process(ranks, kind, schedule):
    _assert_exact(ranks(2).run(cases.equivalence, config={**PP2, "pipeline": schedule}, kind=kind))


def test_clip_grad_norm_counts_the_tied_tensor_once(ranks):
    reports = ranks(2).run(cases.equivalence, config={**PP2, "pipeline": "1f1b"}, clip=0.1, steps=1)
    _assert_exact(reports)
    assert max(r["norm_diff"] for r in reports) < 1e-5, reports


@pytest.mark.parametrize("config", [
    {**PP2, "pipeline": "1f1b"},
    {**PP2, "pipeline": {"schedule": "zbv_zero_bubble", "stages_per_rank": 2}},
    {**PP2, "pipeline": "1f1b", "tensor_parallel_degree": 2},
], ids=["1f1b-fsdp2", "zbv-fsdp2", "1f1b-tp2"])
def test_pp2_x_fsdp2_or_tp2_tied(ranks, config):
    """World 4: FSDP (or TP) over 2 ranks inside each stage; the copies are shards of one layout
    (TP: the vocab-split embedding and the column-split head, both Shard(0)). Under the V schedule
    one rank holds both copies, each FSDP-sharded in its own stage."""
    reports = ranks(4).run(cases.equivalence, config=config, steps=2, clip=0.1)
    _assert_exact(reports)
    assert max(r["norm_diff"] for r in reports) < 1e-5, reports


def test_unsummed_tied_gradients_are_caught(ranks):
    """Negative control: without the sum each copy holds only its own stage's share."""
    reports = ranks(2).run(cases.equivalence, config={**PP2, "pipeline": "1f1b"}, skip_sum=True, steps=1)
    assert max(r["grad_diff"] for r in reports) > 100 * GRAD_TOL, reports
    assert len({d for r in reports for d in r["digests"].values()}) > 1, reports


def test_tied_copies_through_init_checkpoint_and_export(ranks, tmp_path):
    """Delayed (per-stage) init, transform(weights=...) and a checkpoint give both copies the
    model's one tensor; export_hf writes it once and from_pretrained ties it again."""
    reports = ranks(2).run(cases.lifecycle, config={**PP2, "pipeline": "1f1b"},
                           path=str(tmp_path / "ckpt"), export=str(tmp_path / "hf"))
    for r in reports:
        assert r["meta_diff"] == 0.0 and r["export_diff"] == 0.0, r
        assert r["weights_diff"] == 0.0 and r["load_diff"] == 0.0, r
        assert r["export_tied"], r
    for tag in ("meta", "step", "weights", "load"):
        assert len({d for r in reports for d in r["digests"][tag]}) == 1, (tag, reports)


def test_copies_laid_out_differently_are_refused_on_every_rank(ranks):
    for message in ranks(2).run(cases.layout_refusal, config=PP2):
        assert message.startswith("ConfigError: embed / head is one tied tensor whose copies"), message
        assert "shape (8, 4)" in message and "shape (8, 2)" in message, message
