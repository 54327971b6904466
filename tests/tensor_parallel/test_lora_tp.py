"""LoRA (PEFT) under tensor parallel 2 and tensor parallel 2 x FSDP 2 vs one process.

Adapters beside column-wise layers (q, v, gate: lora_A whole, lora_B column-wise) and row-wise
layers (o, down: lora_A row-wise with its partial output all-reduced, or reduce-scattered under
sequence parallel, lora_B whole); the base
weights stay frozen and sharded as without adapters. Loss and every adapter gradient within 1e-5
over two SGD steps; the adapter `save_adapter` writes equals PEFT's `save_pretrained` (and loads
with PeftModel.from_pretrained), the merged weights equal PEFT's `merge_and_unload()`. Negative
controls: a row-wise layer's adapter output left unreduced; frozen norms left trainable by
sequence parallel.
"""

from __future__ import annotations

import pytest

from tests.tensor_parallel import lora_tp_cases

TOL = 1e-5
TP2 = {"tensor_parallel_degree": 2}


TP2_SP = {**TP2, "tensor_parallel": {"sequence_parallel": True}}


@pytest.mark.parametrize("world,config", [(2, TP2), (4, TP2), (2, TP2_SP)], ids=["tp2", "tp2xfsdp2", "tp2-sp"])
def test_lora_matches_single_process(ranks, tmp_path, world, config):
    reports = ranks(world).run(lora_tp_cases.equivalence, config=config, out_dir=str(tmp_path), timeout=300)
    for r in reports:
        assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r
        assert r["frozen_grads"] == 0 and r["adapters"] == 2 * 2 * len(lora_tp_cases.TARGETS), r
    first = reports[0]
    assert first["losses"][1] < first["losses"][0]
    assert first["adapter_keys_equal"] and first["adapter_diff"] < TOL, first
    assert first["reloaded_adapters"] == first["adapters"], first
    assert first["merged_keys_equal"] and first["merged_diff"] < TOL, first


def test_unreduced_adapter_output_is_caught(ranks, tmp_path):
    reports = ranks(2).run(lora_tp_cases.equivalence, config=TP2, out_dir=str(tmp_path), corrupt="unreduced")
    assert max(max(r["loss_diff"], r["grad_diff"]) for r in reports) > 1e-3


def test_frozen_parameters_stay_frozen_under_sequence_parallel(ranks, tmp_path):
    """Negative control: torch's SequenceParallel re-creates the norms' parameters trainable; left
    so, the LoRA model's frozen norms train (5 more trainable tensors) and the run drifts."""
    reports = ranks(2).run(lora_tp_cases.equivalence, config=TP2_SP, out_dir=str(tmp_path), corrupt="unfrozen")
    assert all(r["adapters"] == 2 * 2 * len(lora_tp_cases.TARGETS) + 5 for r in reports), reports
    assert max(max(r["loss_diff"], r["grad_diff"]) for r in reports) > 1e-5


def test_qlora_is_refused_where_bitsandbytes_cannot_run(ranks):
    for message in ranks(2).run(lora_tp_cases.transform_error, config=TP2, quantized=True):
        assert message.startswith("ConfigError") and "bitsandbytes 4-bit" in message, message
        assert "bitsandbytes needs a CUDA device, this run is on cpu" in message, message
