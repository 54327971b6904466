"""LoRA (PEFT) under tensor parallel 2 and tensor parallel 2 x FSDP 2 vs one process.

Adapters beside column-wise layers (q, v, gate: lora_A whole, lora_B column-wise) and row-wise
layers (o, down: lora_A row-wise with its partial output all-reduced, or reduce-scattered under
sequence parallel, lora_B whole); the base
weights stay frozen and sharded as without adapters. Loss and every adapter gradient within 1e-5
over two SGD steps; the adapter `save_adapter` writes equals PEFT's `save_pretrained` (and loads
with PeftModel.from_pretrained), the merged weights equal PEFT's `merge_and_unload()`. Negative
controls: a row-wise layer's adapter output left unreduced; frozen norms left trainable by
sequence parallel.

Beside the other styles the families' own plans put on adapted layers (LoRA on every linear but
the head, the model-coverage cell's case): gathered column-wise layers and their row-wise
partners (OLMo2), GPT-2's packed q|k|v, MLA's whole q_a_proj and kv_a_proj_with_mqa
(DeepSeek-V2), each with its negative control: lora_B split with its output gathered and lora_A's
gradient left unreduced; lora_B split in contiguous rows, not by packed part; q_a_proj's whole
adapter gradient summed as if partial; the rotary-gradient sum hooked on the base layer only.

Beside the output head (`lm_head` in target_modules): gathered with its input whole (adapters
whole), under sequence parallel, loss parallel and both (lora_B split like the head, lora_A
sequence-parallel where the input is split by sequence); the saved folder holds the head's base
weight as PEFT's does. Negative control: lora_A's gradient left as each rank's share.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import smp
from smp.tensor_parallel import lora
from tests.models import model_coverage_cases as coverage_cases
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


@pytest.mark.parametrize("family,config", [("olmo2", TP2), ("olmo2", TP2_SP), ("gpt2", TP2), ("deepseek_v2", TP2)],
                         ids=["gathered", "gathered-sp", "packed-qkv", "mla"])
def test_lora_beside_gathered_packed_and_mla_layers_matches_single_process(ranks, family, config):
    for r in ranks(2).run(coverage_cases.lora_tp2, family=family, config=config, timeout=300):
        assert r["status"] == "exact" and r["detail"]["layers_split"] > 0, r


@pytest.mark.parametrize("family,corrupt", [("olmo2", "gathered_unreduced"), ("gpt2", "packed_contiguous"),
                                            ("deepseek_v2", "mla_q_a_summed"), ("deepseek_v2", "mla_rope_on_base")])
def test_misplaced_adapter_beside_those_layers_is_caught(ranks, family, corrupt):
    for r in ranks(2).run(coverage_cases.lora_tp2, family=family, config=TP2, corrupt=corrupt, timeout=300):
        assert r["status"] == "mismatch", r
        assert max(r["detail"]["loss_diff"], r["detail"]["grad_diff"]) > 1e-3, r


TP2_LP = {**TP2, "tensor_parallel": {"loss_parallel": True}}
TP2_SP_LP = {**TP2, "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True}}
HEAD_ADAPTERS = 2 * 2 * len(lora_tp_cases.TARGETS) + 2  # and lm_head's lora_A, lora_B


@pytest.mark.parametrize("world,config", [(2, TP2), (4, TP2), (2, TP2_SP), (2, TP2_LP), (2, TP2_SP_LP)],
                         ids=["tp2", "tp2xfsdp2", "tp2-sp", "tp2-loss-parallel", "tp2-sp-loss-parallel"])
def test_lora_on_the_output_head_matches_single_process(ranks, tmp_path, world, config):
    reports = ranks(world).run(lora_tp_cases.equivalence, config=config, out_dir=str(tmp_path),
                               targets=lora_tp_cases.HEAD_TARGETS, timeout=300)
    for r in reports:
        assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r
        assert r["frozen_grads"] == 0 and r["adapters"] == HEAD_ADAPTERS, r
    first = reports[0]  # the folder holds lm_head's base weight too, as PEFT's save_pretrained writes it
    assert first["adapter_keys_equal"] and first["adapter_diff"] < TOL, first
    assert first["reloaded_adapters"] == first["adapters"], first
    assert first["merged_keys_equal"] and first["merged_diff"] < TOL, first


@pytest.mark.parametrize("config", [TP2_SP, TP2_LP], ids=["tp2-sp", "tp2-loss-parallel"])
def test_unsummed_head_adapter_gradient_is_caught(ranks, tmp_path, config):
    reports = ranks(2).run(lora_tp_cases.equivalence, config=config, out_dir=str(tmp_path),
                           targets=lora_tp_cases.HEAD_TARGETS, corrupt="head_unsummed")
    assert max(max(r["loss_diff"], r["grad_diff"]) for r in reports) > 1e-3


def test_gathered_layer_with_other_layouts_is_refused():
    """A gathered layer whose output is split by sequence (no style smp builds): smp places no
    adapters there and says so, naming the layouts and the fix."""
    style = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    with pytest.raises(smp.ConfigError, match="lm_head carries LoRA adapters.*layouts are.*target_modules"):
        lora.placement("lm_head", "colwise_gather_output", style)
