"""transformers' `local_params` style: an attention module's own bare per-head parameters
(attention sinks in GraniteSWA, GraniteMoeSWA, MiMo-V2-Flash; Beam's attention-gate bias) split
with its heads by their own 'colwise' entries, the module's forward run on the local shards.

Each family runs its own shipped plan at TP=2 and TP=2 + sequence parallel (world 2), and
GraniteSWA at TP=2 x FSDP 2 + sequence parallel (world 4); loss and every gradient must match
one process within 1e-5 over 3 SGD steps (seen: loss <= 5e-7, gradients <= 4e-7). The per-head
parameters are drawn at random (transformers initialises them to zero, all heads alike), so the
negative control, the same parameters split round-robin while the projections hold contiguous
heads, is caught (loss ~1e-3, sinks gradients ~2e-3, worst gradient ~3e-2).
"""

from __future__ import annotations

import pytest

from tests.tensor_parallel import tp_local_params_cases as cases
from tests.tensor_parallel.tp_vocabulary_cases import assert_matches_one_process

TOL = 1e-5
TP2 = {"tensor_parallel_degree": 2}
TP2_SP = {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}
FAMILIES = ["granite_swa", "granitemoe_swa", "mimo_v2_flash", "beam"]
MATRIX = [(k, c, n) for k in FAMILIES for c, n in ((TP2, "tp2"), (TP2_SP, "tp2-sp"))]


def _check(reports: list[dict]) -> None:
    for report in reports:
        assert report["split_per_head"], report["tp_plan"]  # the style acted
    assert_matches_one_process(reports, TOL)


@pytest.mark.parametrize("kind,config,name", MATRIX, ids=[f"{m[0]}-{m[2]}" for m in MATRIX])
def test_family_matches_single_process(ranks, kind, config, name):
    _check(ranks(2).run(cases.equivalence, config=config, kind=kind, timeout=300))


def test_composes_with_fsdp(ranks):
    """TP=2 x FSDP shard 2 + sequence parallel (world 4): FSDP shards the split sinks further."""
    _check(ranks(4).run(cases.equivalence, config=TP2_SP, kind="granite_swa", timeout=300))


def test_split_misaligned_with_heads_is_caught(ranks):
    """Negative control: sinks split round-robin (rank 0: heads 0, 2) beside q/k/v split
    contiguously (rank 0: heads 0, 1): every rank applies other heads' sinks."""
    report = ranks(2).run(cases.equivalence, config=TP2, kind="granite_swa", misalign=True, steps=1)[0]
    assert report["split_per_head"], report["tp_plan"]
    assert report["loss_diff"] > 10 * TOL, report["loss_diff"]
    assert report["grad_diffs"]["model.layers.0.self_attn.sinks"] > 100 * TOL, report["grad_diffs"]


# ----------------------------------------------------------------------------- refusals


def test_parameter_without_its_entry_is_refused(ranks):
    """The owner styled 'local_params', its sinks left whole: every rank would read all heads'."""
    plan = cases.own_plan("granite_swa", drop=(".sinks",))
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="granite_swa", plan=plan):
        assert message.startswith("ConfigError") and "'model.layers.0.self_attn.sinks' (4,) has no entry" in message, message
        assert "'colwise'" in message, message


def test_parameter_split_other_than_by_head_is_refused(ranks):
    plan = cases.own_plan("granite_swa", **{".sinks": "rowwise"})
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="granite_swa", plan=plan):
        assert message.startswith("ConfigError") and "has style 'rowwise'" in message, message
        assert "takes 'colwise'" in message, message


def test_owner_with_whole_heads_is_refused(ranks):
    """'local_params' where nothing splits the heads: split sinks would not match them."""
    plan = cases.own_plan("granite_swa", drop=("_proj",))
    for message in ranks(2).run(cases.transform_error, config=TP2, kind="granite_swa", plan=plan):
        assert message.startswith("ConfigError") and "no projection inside it is split" in message, message
