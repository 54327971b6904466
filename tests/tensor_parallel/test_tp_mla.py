"""Tensor parallel on multi-head latent attention (`mla_kv_a_proj`: DeepSeek-V2, MiniCPM3), vs
the single-process run.

The model's own plan splits the up-projections (q_proj / q_b_proj, kv_b_proj) and o_proj and
keeps the down-projections whole; the rotary key slice of `kv_a_proj_with_mqa`'s output feeds
every head, so its gradient is summed over the TP ranks. Loss and every gradient must match one
process within 1e-5 over 3 SGD steps (seen: loss <= 2e-6, gradients <= 3e-7). The negative
control leaves that slice's gradient unsummed and must be caught (seen: ~5e-4 on DeepSeek-V2,
~2e-2 on MiniCPM3, largest on kv_a_proj_with_mqa.weight).
"""

from __future__ import annotations

import pytest

from tests.tensor_parallel import tp_mla_cases as cases

TOL = 1e-5
TP2 = {"tensor_parallel_degree": 2}
TP2_SP = {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}
MATRIX = [(k, c, n) for k in ("minicpm3", "deepseek_v2") for c, n in ((TP2, "tp2"), (TP2_SP, "tp2-sp"))]
KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa"


@pytest.mark.parametrize("kind,config,name", MATRIX, ids=[f"{m[0]}-{m[2]}" for m in MATRIX])
def test_mla_matches_single_process(ranks, kind, config, name):
    reports = ranks(2).run(cases.equivalence, config=config, kind=kind, timeout=300)
    for report in reports:
        assert report["sharded"] > 0, report
        assert report["loss_diff"] < TOL, report
        assert report["grad_diff"] < TOL, sorted(report["grad_diffs"].items(), key=lambda kv: -kv[1])[:3]
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]  # it trains
    applied = reports[0]["tp_plan"]
    assert applied[KV_A] == "mla_kv_a_proj", applied
    assert applied["model.layers.0.self_attn.kv_a_layernorm"].startswith("replicate (auto:"), applied


@pytest.mark.parametrize("kind", ["minicpm3", "deepseek_v2"])
def test_unsummed_rotary_key_gradient_is_caught(ranks, kind):
    """Negative control: each rank keeps its own heads' share of the rotary key gradient."""
    report = ranks(2).run(cases.equivalence, config=TP2, kind=kind, break_rope_sum=True, timeout=300)[0]
    assert report["grad_diffs"][KV_A + ".weight"] > 10 * TOL, report["grad_diffs"]


def test_mla_entry_outside_a_split_region_is_refused(ranks):
    """With attention left whole, the rotary key gradient is already whole: summing it would
    double it, so the entry is refused, naming the module and the fix."""
    plan = {"model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}
    error = ranks(2).run(cases.transform_error, config=TP2, kind="minicpm3", plan=plan)[0]
    assert error.startswith("ConfigError:"), error
    assert "'model.layers.0.self_attn' holds an 'mla_kv_a_proj' layer" in error and "double" in error, error
