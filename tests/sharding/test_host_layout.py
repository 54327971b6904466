"""smp's unit layouts vs today's one FSDP unit per block: bitwise (loss, every gradient, every
parameter after AdamW steps, bf16 params + fp32 reduce under bf16 autocast), each with a
deliberately wrong layout beside it that the same comparison catches.

- one-rank shard group: no FSDP units, smp casts the parameters itself (smp/sharding/cast_params.py);
- more ranks: consecutive small blocks merged into one FSDP unit (MIN_UNIT_BYTES).
"""

from __future__ import annotations

import pytest

from tests.sharding import host_layout_cases as cases

BF16 = cases.BF16


def _bitwise(report: dict) -> bool:
    return report["loss_equal"] and report["grads_equal"] and report["params_equal"]


@pytest.mark.parametrize("config,micro_batches", [
    (BF16, 1),
    (BF16, 2),  # smp.no_sync accumulation: FSDP sums float32 gradients, so does the cast layout
    ({**BF16, "activation_checkpointing": "full"}, 1),  # recompute reads the casts
    ({**BF16, "activation_checkpointing": "selective"}, 1),
    ({**BF16, "mixed_precision": {**BF16["mixed_precision"], "output_dtype": "fp32"}}, 1),
], ids=["bf16", "no-sync", "full-ckpt", "selective-ckpt", "output-fp32"])
def test_one_rank_cast_layout_is_bitwise_per_block_fsdp(ranks, config, micro_batches):
    (report,) = ranks(1).run(cases.layout_vs_per_block, config=config, micro_batches=micro_batches)
    assert report["units"] == 0 and report["base_units"] == 5, report  # 4 blocks + root before
    assert report["param_types"] == ["Parameter"] and report["param_dtypes"] == ["torch.float32"], report
    assert _bitwise(report), report
    assert "no FSDP units" in report["layout"]


@pytest.mark.parametrize("variant,micro_batches", [
    ("no_param_cast", 1),  # casts at the wrong point: fp32 weights under autocast
    ("bf16_accumulation", 2),  # the fp32 reduce dropped: micro-batch gradients summed in bf16
])
def test_one_rank_broken_layouts_are_caught(ranks, variant, micro_batches):
    (report,) = ranks(1).run(cases.layout_vs_per_block, config=BF16, micro_batches=micro_batches, variant=variant)
    assert not report["grads_equal"] and not report["params_equal"], report
    assert report["grad_diff"] > 1e-4, report


def test_one_rank_block_input_casts(ranks):
    """Blocks fed float32 (Toy): the cast layout casts each block's inputs as FSDP's units do;
    without those casts (the negative control) the blocks compute in float32 and differ."""
    (report,) = ranks(1).run(cases.layout_vs_per_block, config=BF16, kind="toy")
    assert report["units"] == 0 and _bitwise(report), report
    (broken,) = ranks(1).run(cases.layout_vs_per_block, config=BF16, kind="toy", variant="block_inputs_uncast")
    assert not broken["grads_equal"] and broken["grad_diff"] > 1e-4, broken


def test_one_rank_cast_layout_under_compile(ranks):
    (report,) = ranks(1).run(cases.layout_vs_per_block, config=BF16, steps=2, compile_backend="aot_eager")
    assert report["units"] == 0 and _bitwise(report), report


def test_readers_see_float32_parameters(ranks):
    """Between steps (and after a no-grad forward) every slot holds its float32 parameter again:
    state dicts, clip_grad_norm_ and the optimizer read what they read without smp."""
    (seen,) = ranks(1).run(cases.reads_after_step, config=BF16)
    assert seen["during"] == ["torch.bfloat16"], seen  # the casts sit in the slots from forward to backward
    assert seen["after"] == seen["after_eval"] == seen["state"] == seen["grad_dtypes"] == ["torch.float32"], seen
    assert seen["norm_equal"], seen


@pytest.mark.parametrize("config", [
    BF16,  # 4 tiny blocks merged into one unit, + the root
    {**BF16, "activation_checkpointing": "full"},
    {},  # fp32
], ids=["bf16", "bf16-full-ckpt", "fp32"])
def test_two_ranks_merged_units_are_bitwise_per_block(ranks, config):
    for report in ranks(2).run(cases.layout_vs_per_block, config=config, steps=2):
        assert report["base_units"] == 5 and report["units"] == 5, report  # grouped modules are each an FSDPModule
        assert "1 FSDP unit over 4 blocks" in report["layout"] and "merged" in report["layout"], report
        assert _bitwise(report), report


def test_two_ranks_merged_units_with_bf16_reduce_is_caught(ranks):
    """Negative control: the merged layout with its fp32 reduce dropped (bf16 reduce-scatter)."""
    for report in ranks(2).run(cases.layout_vs_per_block, config=BF16, steps=2, variant="bf16_reduce"):
        assert not report["grads_equal"], report


def test_one_rank_cast_layout_resumes_bitwise(ranks, tmp_path):
    """smp.checkpointing save/load of the cast layout (plain float32 parameters between steps)."""
    from tests.checkpointing import checkpoint_cases

    (r,) = ranks(1).run(checkpoint_cases.exact_resume, config=BF16, root=str(tmp_path), steps=3, save_at=1)
    assert r["resumed"] == r["losses"][1:] and r["param_diff"] == 0.0, r


def test_tensor_parallel_over_a_one_rank_shard_group(ranks):
    """TP 2 at world 2 with bf16 params: the shard group has one rank but the parameters are
    DTensors (FSDP sums their pending-sum gradients in bf16), so FSDP stays, its blocks merged;
    bitwise the per-block units' run."""
    config = {**BF16, "tensor_parallel_degree": 2}
    for report in ranks(2).run(cases.layout_vs_per_block, config=config, steps=2):
        assert report["units"] == 5 and "merged" in report["layout"], report
        assert _bitwise(report), report
