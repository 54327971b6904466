"""Models users bring, never silently wrong: tied parameters across FSDP units (BERT masked LM),
nested configs under activation checkpointing (T5), tied parameters under delayed init (T5,
BERT-MLM, GPT-2), every way to build a meta model (Llama), and `load_hf` loading what
`from_pretrained` loads. Each compares with one process (loss and gradients within 1e-5,
delayed-init parameters bitwise), with a negative control beside it.
"""

from __future__ import annotations

import pytest
import torch

from tests.models import model_coverage_cases as cases

TOL = cases.TOL


# --- 1. tied parameters and FSDP units -------------------------------------------------------

def test_bert_mlm_matches_single_process(ranks):
    """BERT's word embeddings (an FSDP unit by `_no_split_modules`) are tied to the MLM decoder
    in the root: FSDP2 refused the model at the first forward."""
    reports = ranks(2).run(cases.equivalence, config={}, family="bert-mlm")
    for r in reports:
        assert r["param_diff"] == 0.0 and r["loss_diff"] < TOL and r["grad_diff"] < TOL, r
    assert reports[0]["losses"][1] < reports[0]["losses"][0]  # it trains


def test_bert_mlm_broken_sync_is_caught(ranks):
    reports = ranks(2).run(cases.equivalence, config={}, family="bert-mlm", steps=1, break_sync=True)
    assert max(r["grad_diff"] for r in reports) > 100 * TOL


def test_tied_blocks_stay_in_one_unit():
    """Any model: a candidate unit that shares a parameter with another unit or the root is
    left to the root; units sharing nothing stay units."""
    from torch import nn

    from smp.sharding import find_blocks

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 4)
            self.head.weight = self.layers[0].weight  # layer 0 tied to the root's head
            self.layers[2].bias = self.layers[1].bias  # layers 1 and 2 tied to each other

    model = Tied()
    assert find_blocks(model) == []
    model.layers.append(nn.Linear(4, 4))
    assert find_blocks(model) == [model.layers[3]]
    bert = cases.tiny_bert_mlm()
    blocks = find_blocks(bert)
    assert bert.bert.embeddings not in blocks and list(bert.bert.encoder.layer) == blocks


# --- 2. activation checkpointing with nested configs -----------------------------------------

def test_t5_full_checkpointing_matches_single_process(ranks):
    for r in ranks(2).run(cases.equivalence, config={"activation_checkpointing": "full"}, family="t5"):
        assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


def test_t5_decoder_cache_left_on_fails_recompute(ranks):
    """Negative control: the decoder's own config copy is what has to be switched off."""
    for message in ranks(2).run(cases.t5_checkpointing_with_decoder_cache, config={"activation_checkpointing": "full"}):
        assert "different number of tensors" in message, message


def test_every_config_turns_off_use_cache():
    from transformers import GenerationConfig

    from smp.activations import apply_activation_checkpointing
    from smp.sharding import find_blocks

    model = cases.tiny_t5()
    model.generation_config = GenerationConfig(use_cache=True)
    apply_activation_checkpointing(model, find_blocks(model), mode="full")
    configs = [model.config, model.encoder.config, model.decoder.config, model.generation_config]
    assert [c.use_cache for c in configs] == [False] * 4


# --- 3. tied parameters under delayed initialisation -----------------------------------------

@pytest.mark.parametrize("family", ["t5", "bert-mlm", "gpt2"])
def test_delayed_init_tied_parameters_equal_eager(ranks, family):
    for r in ranks(2).run(cases.equivalence, config={}, family=family, steps=1, delayed=True):
        assert r["param_diff"] == 0.0, r  # bitwise: same draws, tied value from the tie source
        assert r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


# --- 4. every way to build a meta model ------------------------------------------------------

@pytest.mark.parametrize("idiom", cases.META_IDIOMS)
def test_meta_model_materialises_as_eager(ranks, tmp_path, idiom):
    config = {"delayed_param_initialization": True}
    for r in ranks(2).run(cases.meta_idiom, config=config, idiom=idiom, saved_dir=str(tmp_path / "saved")):
        assert r["error"] == "", r
        assert r["param_diff"] == 0.0, r  # parameters and buffers bitwise equal to eager
        assert r["grad_diff"] < TOL and r["loss"] == r["loss"], r


def test_meta_model_with_hf_marks_left_set_is_refused(ranks, tmp_path):
    """Negative control: with accelerate's `_is_hf_initialized` marks kept, the replay skips the
    inits; the values no init wrote must be refused by name, never trained on."""
    for r in ranks(2).run(cases.meta_idiom, config={}, idiom="accelerate", saved_dir=str(tmp_path),
                          keep_hf_marks=True):
        assert "cannot re-create" in r["error"] and "layernorm.weight" in r["error"], r


def test_constructor_only_buffer_is_refused():
    """A buffer set only in a constructor cannot be re-created on meta: refused, not garbage."""
    from torch import nn

    from smp.errors import ConfigError
    from smp.sharding import materialize_meta_model

    class Scaled(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("scale", torch.full((4,), 3.0))

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ConfigError, match="scale"):
        materialize_meta_model(model, torch.device("cpu"), seed=0)


# --- 5. load_hf loads what from_pretrained loads ---------------------------------------------

LOADABLE = ["sentence_transformers", "bert_prefixed", "bert_base_into_mlm", "llama_base",
            "llama_prefixed_into_base", "llama_sharded_tied", "llama_tied_twice"]


@pytest.mark.parametrize("kind", LOADABLE)
def test_load_hf_loads_what_from_pretrained_loads(ranks, tmp_path, kind):
    reports = ranks(2).run(cases.load_hf_like_from_pretrained, config={}, kind=kind, directory=str(tmp_path / kind))
    for r in reports:
        assert r["error"] == "", r["error"]
        assert r["param_diff"] == 0.0, r
    rank0, rank1 = reports
    assert rank1["warnings"] == []  # reported once, on rank 0
    if kind == "sentence_transformers":
        assert len(rank0["warnings"]) == 1 and "embeddings.position_ids" in rank0["warnings"][0], rank0
    if kind == "llama_sharded_tied":
        assert len(rank0["files"]) > 1, rank0
    if kind == "llama_tied_twice":
        assert "lm_head.weight" in rank0["warnings"][0], rank0


def test_load_hf_still_raises_for_keys_that_do_not_match(ranks, tmp_path):
    for r in ranks(2).run(cases.load_hf_like_from_pretrained, config={}, kind="wrong_key", directory=str(tmp_path)):
        assert "unexpected keys (1" in r["error"] and "encoder.layer.9.output.dense.weight" in r["error"], r
