"""Vision and multimodal models (and the tied-embedding text models they share a path with):
pretrained weights in and out (`export_hf`, `load_hf` through transformers' own key
conversion, a meta model loaded from a folder), each proven against transformers'
`from_pretrained` or one process, each with a negative control beside it."""

from __future__ import annotations

import pytest

from tests import vlm_cases as cases


@pytest.mark.parametrize("family", cases.TIED_TEXT_FAMILIES)
def test_tied_embeddings_export_round_trip(ranks, family):
    """Tied input/output embeddings: export_hf writes one copy (as save_pretrained does) and
    from_pretrained restores the tie, every tensor bitwise equal to the trained sharded model."""
    for r in ranks(2).run(cases.tied_export_round_trip, config={}, family=family, timeout=240):
        assert r["error"] == "" and r["diff"] == 0.0 and r["tied"], r


def test_tied_embeddings_written_twice_is_refused_by_safetensors(ranks):
    """Negative control: both names of the tied weight written, as before the fix."""
    for r in ranks(2).run(cases.tied_export_round_trip, config={}, family="llama-tied", keep_both=True, timeout=240):
        assert "share memory" in r["error"], r


PRETRAINED = ("llava", "qwen2_5_vl", "gemma3", "paligemma", "mllama", "vit", "dinov2", "siglip")


@pytest.mark.parametrize("family", PRETRAINED)
def test_pretrained_round_trip(ranks, family):
    """The folder transformers' save_pretrained writes (older key layouts for LLaVA, Qwen2.5-VL,
    Gemma3, PaliGemma, Mllama, ViT, DINOv2) loads through load_hf into the transformed model
    exactly as from_pretrained loads it, and export_hf of it loads back bitwise."""
    for r in ranks(2).run(cases.pretrained_round_trip, config={}, family=family, timeout=240):
        assert r["error"] == "" and r["loaded_diff"] == 0.0 and r["round_trip_diff"] == 0.0, r


def test_pretrained_without_key_conversion_is_refused(ranks):
    """Negative control: without transformers' key conversion the older layout is refused
    (missing / unexpected keys), never loaded wrong."""
    for r in ranks(2).run(cases.pretrained_round_trip, config={}, family="llava", convert=False, timeout=240):
        assert "missing keys" in r["error"] and "language_model.model." in r["error"], r


@pytest.mark.parametrize("family", PRETRAINED + ("llama-tied", "gpt2"))
def test_meta_model_loads_pretrained_weights(ranks, family):
    """Build on meta, transform without materialising, load_hf: every parameter and buffer
    (non-persistent ones computed as from_pretrained computes them) bitwise equal to
    from_pretrained + transform, for the families delayed init refuses too."""
    for r in ranks(2).run(cases.meta_load, config={}, family=family, timeout=240):
        assert r["error"] == "" and r["diff"] == 0.0, r


def test_meta_model_buffers_left_empty_are_caught(ranks):
    """Negative control: non-persistent buffers left as to_empty memory (the rotary inv_freq of
    a meta Llama) are caught by the comparison."""
    results = ranks(2).run(cases.meta_load, config={}, family="llama-tied", compute_buffers=False, timeout=240)
    assert any(r["diff"] > 0.0 for r in results), results
