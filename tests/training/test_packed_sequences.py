"""Packed sequences (several documents per row, position ids restarting at each, no padding)
under FSDP, TP + sequence parallel, context parallel (ring, all-gather, Ulysses), pipeline
parallel (every schedule at PP 2, x TP, x FSDP, x CP) and expert parallel (Mixtral, EP 2) vs one
process running transformers' own model on the whole packed batch.

The reference itself is checked first: the packed loss and gradients in one process equal the
documents run one by one (measured: loss ~1e-7, gradients ~1e-8). Tolerances as
tests/context_parallel/test_context_parallel.py: 1e-5 on loss and every gradient. Negative controls: positions
that do not restart, attention that ignores the documents' boundaries, Ulysses heads put back in
the wrong order, labels that let a document predict the next one's first token, pipeline stages
not handed the positions (measured: loss 1.6e-2, gradients 7.2e-2 under 1F1B, 1.4e-2 / 7.1e-2
under interleaved 1F1B and ZBV; the exact runs, every schedule and composition: loss <= 4.8e-7,
gradients <= 4.1e-8), positions not restarting under EP (gradients 9.8e-2; exact: 2.8e-8).
"""

from __future__ import annotations

import pytest
import importlib

import torch

from smp.config import PIPELINE_SCHEDULES
from smp.context_parallel.sharding import document_starts, shard_batch
from smp.pipeline import SCHEDULE_CLASSES
from tests.training import packed_cases

cp_attention = importlib.import_module("smp.context_parallel.attention")  # the module, not the function

TOL = 1e-5
CP2 = {"context_parallel_degree": 2}


def _check(reports: list[dict]) -> None:
    for report in reports:
        assert report["loss_diff"] < TOL, report
        assert report["grad_diff"] < TOL, report
        assert report.get("eval_diff", 0.0) < TOL, report  # smp.step's cases: smp.evaluate after each step
    assert reports[0]["losses"][1] < reports[0]["losses"][0]  # it trains


def _broken(reports: list[dict]) -> float:
    return max(max(r["loss_diff"], r["grad_diff"]) for r in reports)


# --- The reference: one process, transformers' own model ---------------------------------------


def test_packed_reference_equals_documents_one_by_one():
    r = packed_cases.reference_vs_documents()
    assert r["targets"] == 4 * 13
    assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


@pytest.mark.parametrize("variant", ["global_positions", "cache", "no_boundary_labels"])
def test_packed_reference_negative_controls(variant):
    """Positions that do not restart, a cache in train mode (transformers then attends across
    documents), or labels across boundaries: the packed run no longer equals the documents."""
    r = packed_cases.reference_vs_documents(variant=variant)
    assert max(r["loss_diff"], r["grad_diff"]) > 1e-3, r


def test_local_attention_is_per_document():
    """smp.context_parallel.attention in one process (no cp): a packed row equals each document
    attended alone."""
    torch.manual_seed(0)
    lengths = [5, 7, 4]
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out = cp_attention.attention(q, k, v, causal=True, position_ids=positions)
    at = 0
    for n in lengths:
        part = slice(at, at + n)
        alone = torch.nn.functional.scaled_dot_product_attention(q[..., part, :], k[..., part, :], v[..., part, :],
                                                                 is_causal=True)
        assert torch.allclose(out[..., part, :], alone, atol=1e-6)
        at += n
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - whole).abs().max() > 1e-2  # the boundaries matter


def test_shard_batch_cuts_labels_at_document_boundaries():
    ids = torch.arange(8)[None]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert document_starts(positions).tolist() == [[False, False, False, True, False, False, False, False]]
    out = shard_batch({"input_ids": ids, "position_ids": positions}, cp_size=2, cp_rank=0, load_balance=False)
    assert out["labels"].tolist() == [[1, 2, -100, 4]]  # token 2 ends its document
    assert out["position_ids"].tolist() == [[0, 1, 2, 0]]


# --- Layouts vs one process --------------------------------------------------------------------

LAYOUTS = {
    "fsdp2": (2, {}),
    "tp2-sp": (2, {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}),
    "cp2-ring": (2, CP2),
    "cp2-ring-unbalanced": (2, {**CP2, "context_parallel": {"load_balance": False}}),
    "cp2-allgather": (2, {**CP2, "context_parallel": {"algorithm": "allgather"}}),
    "cp2-ulysses": (2, {**CP2, "context_parallel": {"algorithm": "ulysses"}}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_matches_single_process(ranks, layout):
    world, config = LAYOUTS[layout]
    _check(ranks(world).run(packed_cases.equivalence, config=config, timeout=300))


@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_packed_user_model_under_context_parallel(ranks, algorithm):
    config = {**CP2, "context_parallel": {"algorithm": algorithm}}
    _check(ranks(2).run(packed_cases.equivalence, config=config, kind="user"))


@pytest.mark.parametrize("layout", ["fsdp2", "tp2-sp", "cp2-ring"])
def test_global_positions_are_caught(ranks, layout):
    """Negative control: the smp run's positions do not restart at each document."""
    world, config = LAYOUTS[layout]
    assert _broken(ranks(world).run(packed_cases.equivalence, config=config, variant="global_positions")) > 1e-3


@pytest.mark.parametrize("layout", ["cp2-ring", "cp2-allgather", "cp2-ulysses"])
def test_mask_ignoring_boundaries_is_caught(ranks, layout):
    """Negative control: context parallel attention that treats each row as one document."""
    world, config = LAYOUTS[layout]
    assert _broken(ranks(world).run(packed_cases.equivalence, config=config, corrupt="ignore_boundaries")) > 1e-3


@pytest.mark.parametrize("padded,jump,expected", [
    (True, False, "packed rows (position_ids restart inside a row) and an attention_mask"),
    (False, True, "jump from"),
])
def test_packed_with_padding_is_refused_on_every_rank(ranks, padded, jump, expected):
    for message in ranks(2).run(packed_cases.shard_error, config=CP2, padded=padded, jump=jump):
        assert message.startswith("UsageError") and expected in message, message


# --- Through smp.step, the one training step for every layout ---------------------------------


@pytest.mark.parametrize("config,use_cache", [
    ({}, False),  # FSDP 2: transformers' own packed masks need use_cache=False,
    ({}, None),  # which smp.step passes when the batch does not say
    # context parallel: smp's attention reads the documents itself, whatever use_cache says
    (CP2, None), ({**CP2, "context_parallel": {"algorithm": "ulysses"}}, None),
], ids=["fsdp2", "fsdp2-cache-unsaid", "cp2-ring", "cp2-ulysses"])
def test_packed_through_smp_step(ranks, config, use_cache):
    _check(ranks(2).run(packed_cases.step_equivalence, config=config, use_cache=use_cache, timeout=300))


# --- Pipeline parallel: every stage is handed the packed positions ---------------------------

PP2 = {"pipeline_parallel_degree": 2, "pipeline": {"microbatches": 2}}


def _pp2(schedule: str, microbatches: int = 4, **more) -> dict:
    """PP 2 under `schedule` at its default stages per rank (two but for gpipe: the case model
    gets a layer per stage); 4 micro-batches of one row each, the fewest dualpipev takes."""
    return {"pipeline_parallel_degree": 2, "pipeline": {"schedule": schedule, "microbatches": microbatches}, **more}


PIPELINE_LAYOUTS = {
    "pp2": (2, PP2),
    "pp2-tp2": (4, {**PP2, "tensor_parallel_degree": 2}),
    "pp2-fsdp2": (4, PP2),
    "pp2-cp2": (4, {**PP2, **CP2}),
    # every other schedule ("pp2" is 1f1b): several stages per rank, the V, the split backward
    **{f"pp2-{schedule}": (2, _pp2(schedule)) for schedule in PIPELINE_SCHEDULES if schedule != "1f1b"},
    # every axis > 1: a V with a split backward over stages FSDP shards; interleaved over TP
    "pp2-fsdp2-zbv_zero_bubble": (4, _pp2("zbv_zero_bubble", microbatches=2)),
    "pp2-tp2-interleaved_1f1b": (4, _pp2("interleaved_1f1b", microbatches=2, tensor_parallel_degree=2)),
}


def _layouts(*names: str) -> list:
    """Layout names as parameters; those of world 4 marked slow (tests/conftest.py)."""
    return [pytest.param(n, marks=pytest.mark.slow) if PIPELINE_LAYOUTS[n][0] > 2 else n for n in names]


def _check_every_gradient(reports: list[dict]) -> None:
    _check(reports)
    seen = {name for r in reports for name in r["grads"]}
    assert seen == set(reports[0]["all_grads"]), sorted(set(reports[0]["all_grads"]) - seen)


@pytest.mark.parametrize("layout", _layouts(*PIPELINE_LAYOUTS))
def test_packed_pipeline_through_smp_step(ranks, layout):
    world, config = PIPELINE_LAYOUTS[layout]
    reports = ranks(world).run(packed_cases.step_equivalence, config=config, use_cache=None, timeout=300)
    _check_every_gradient(reports)
    schedule = SCHEDULE_CLASSES[config["pipeline"].get("schedule", "1f1b")].__name__
    assert all(r["schedules"] == [schedule] for r in reports), reports


def test_packed_pipeline_without_labels(ranks):
    """No labels: the pipeline trains on input_ids as the whole model does (each document's last
    token predicting the next one's first)."""
    _check_every_gradient(ranks(2).run(packed_cases.step_equivalence, config=PP2, use_cache=None, labels=False))


@pytest.mark.parametrize("layout", _layouts("pp2", "pp2-cp2", "pp2-interleaved_1f1b", "pp2-zbv_zero_bubble"))
def test_packed_pipeline_positions_not_sent_are_caught(ranks, layout):
    """Negative control: the stages are not handed the positions (each counts 0, 1, 2, ...)."""
    world, config = PIPELINE_LAYOUTS[layout]
    reports = ranks(world).run(packed_cases.step_equivalence, config=config, use_cache=None,
                               broken="positions_not_sent", steps=1)
    assert _broken(reports) > 1e-3, reports


@pytest.mark.parametrize("layout,padded,jump,expected", [
    ("pp2", True, False, "packed rows (position_ids restart inside a row) and an attention_mask"),
    ("pp2-cp2", True, False, "packed rows (position_ids restart inside a row) and an attention_mask"),
    ("pp2-cp2", False, True, "(context parallel): position_ids of row 0 jump from"),
])
def test_packed_pipeline_refusals_on_every_rank(ranks, layout, padded, jump, expected):
    world, config = PIPELINE_LAYOUTS[layout]
    for message in ranks(world).run(packed_cases.step_error, config=config, padded=padded, jump=jump):
        assert message.startswith("UsageError") and expected in message, message


# --- Expert parallel: the experts see tokens, the attention sees the documents ---------------

EP2 = {"expert_parallel_degree": 2}


def test_packed_expert_parallel_through_smp_step(ranks):
    reports = ranks(2).run(packed_cases.step_equivalence, config=EP2, kind="mixtral", use_cache=None, timeout=300)
    _check_every_gradient(reports)
    assert all(r["expert_parallel_modules"] == 2 for r in reports), reports  # both layers' experts split


def test_packed_expert_parallel_global_positions_are_caught(ranks):
    """Negative control: under EP the smp run's positions do not restart at each document."""
    reports = ranks(2).run(packed_cases.step_equivalence, config=EP2, kind="mixtral", use_cache=None,
                           broken="global_positions", steps=1)
    assert _broken(reports) > 1e-3, reports
