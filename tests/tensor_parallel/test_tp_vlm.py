"""Tensor parallel on multimodal, vision and speech models, vs the single-process run.

Sequence parallel applies to the language model only: a tiny LLaVA (CLIP vision tower, Llama text
model) at TP=2 and TP=2 + sequence parallel, where the vision tower is split by smp's CLIP table
and runs as without sequence parallel, the projector stays whole on every rank, and the language
model's `inputs_embeds` (token embeddings with the image features scattered in) enter the
sequence shards at its entry. Loss and every gradient (the vision tower's too) must
match one process within 1e-5 over 3 SGD steps. The negative control flips rank 1's images, which
the comparison must catch.
"""

from __future__ import annotations

import pytest
import torch

from tests.tensor_parallel import tp_vlm_cases as cases
from tests.tensor_parallel.tp_vocabulary_cases import assert_matches_one_process

TOL = 1e-5
TP2 = {"tensor_parallel_degree": 2}
TP2_SP = {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}


@pytest.mark.parametrize("config", [TP2, TP2_SP], ids=["tp2", "tp2-sp"])
def test_llava_matches_single_process(ranks, config):
    reports = ranks(2).run(cases.equivalence, config=config, kind="llava", timeout=300)
    assert reports[0]["sharded"] > 0, reports[0]
    assert_matches_one_process(reports, TOL)
    applied = reports[0]["tp_plan"]
    assert applied["model.vision_tower.encoder.layers.0.mlp.fc1"] == "colwise", applied  # smp's CLIP table
    assert not any(n.startswith("model.multi_modal_projector") for n in applied), applied
    assert not any(n.startswith("model.vision_tower") and s not in ("colwise", "rowwise", "region_entry")
                   for n, s in applied.items()), applied
    if "tensor_parallel" in config:
        assert applied["model.language_model"].startswith("shard_sequence (auto:"), applied
        assert applied["model.language_model.norm"] == "sequence_parallel", applied


@pytest.mark.parametrize("kind", ["gemma3", "paligemma"])
def test_siglip_tower_vlms_match_single_process(ranks, kind):
    """Gemma3 and PaliGemma at TP=2 + sequence parallel: their SigLIP towers split by smp's table,
    their language models by their own plans. Gemma3 compares in float64: in float32 its
    projector's gradient (entries up to ~160) differs by 1.4e-4 from the summation order alone
    (3.5e-10 in float64, on gradients of the same scale)."""
    dtype = torch.float64 if kind == "gemma3" else torch.float32
    reports = ranks(2).run(cases.equivalence, config=TP2_SP, kind=kind, dtype=dtype, timeout=300)
    assert_matches_one_process(reports, TOL)
    applied = reports[0]["tp_plan"]
    assert applied["model.vision_tower.encoder.layers.0.self_attn.q_proj"] == "colwise", applied
    assert applied["model.language_model"].startswith("shard_sequence (auto:"), applied


def test_llava_flipped_image_is_caught(ranks):
    """Negative control: rank 1 sees its images mirrored; the vision tower's gradients (and the
    loss) must then differ from one process by far more than the tolerance."""
    reports = ranks(2).run(cases.equivalence, config=TP2_SP, kind="llava", steps=1, flip_image=True, timeout=300)
    assert min(r["grad_diff"] for r in reports) > 100 * TOL, [r["grad_diff"] for r in reports]


# The contrastive families compare in float64: in float32 their text embeddings' gradients
# (magnitude ~3.5, scaled by the logit scale 14.3) differ from one process by 1.6e-5 on the first
# step already, rounding of the summation order (in float64 the same run differs by 2e-14).
DTYPES = {"clip": torch.float64, "siglip": torch.float64}


@pytest.mark.parametrize("kind", cases.VISION_FAMILIES)
def test_vision_and_speech_tables_match_single_process(ranks, kind):
    """ViT, DINOv2, CLIP, SigLIP (both towers) and Whisper (encoder, decoder, cross-attention)
    ship no TP plan: smp's table splits their attention by heads and their MLP by features."""
    dtype = DTYPES.get(kind, torch.float32)
    reports = ranks(2).run(cases.equivalence, config=TP2, kind=kind, dtype=dtype, timeout=300)
    assert reports[0]["sharded"] > 0, reports[0]
    assert_matches_one_process(reports, TOL)
    assert reports[0]["tp_plan"], reports[0]


def test_mllama_matches_single_process(ranks):
    """Mllama (Llama 3.2 Vision) ships no TP plan: smp's table splits its tower's local and global
    layers and its decoder's self- and cross-attention layers; the embeddings stay whole.
    Negative control beside it: one row-wise layer's partial sums left unsummed."""
    reports = ranks(2).run(cases.equivalence, config=TP2, kind="mllama", timeout=300)
    plan = reports[0]["tp_plan"]
    for part in ("vision_model.transformer.layers", "vision_model.global_transformer.layers",
                 "language_model.layers.1.cross_attn", "language_model.layers.0.self_attn"):
        assert any(part in name for name in plan), (part, sorted(plan))
    assert_matches_one_process(reports, TOL)
    broken = ranks(2).run(cases.equivalence, config=TP2, kind="mllama", corrupt=True, timeout=300)
    assert max(r["grad_diff"] for r in broken) > 10 * TOL, broken  # 1.4e-4: the tower feeds one gated layer


@pytest.mark.parametrize("kind", cases.VISION_FAMILIES)
def test_vision_and_speech_missing_all_reduce_is_caught(ranks, kind):
    """Negative control: one row-wise layer's partial sums left unsummed."""
    reports = ranks(2).run(cases.equivalence, config=TP2, kind=kind, steps=1, corrupt=True, timeout=300)
    assert max(max(r["grad_diff"], r["loss_diff"]) for r in reports) > 100 * TOL, [r["grad_diff"] for r in reports]


REFUSED_SP = {"vit": "ViTForImageClassification", "dinov2": "Dinov2ForImageClassification", "clip": "CLIPModel",
              "siglip": "SiglipModel", "whisper": "WhisperForConditionalGeneration"}


@pytest.mark.parametrize("kind", cases.VISION_FAMILIES)
def test_sequence_parallel_on_vision_and_speech_models_is_refused(ranks, kind):
    """Sequence parallel shards a language model's token sequence only: ViT, DINOv2, CLIP, SigLIP
    (patches read off one position by a classifier or pooler) and Whisper (audio frames; inline
    decoder layers) are refused on every rank before the model is changed, naming the model,
    the reason and the fix (tensor parallel alone is exact on them, the tests above)."""
    for error in ranks(2).run(cases.sequence_parallel_refusal, config=TP2_SP, kind=kind, timeout=300):
        assert error.startswith("ConfigError: sequence_parallel: " + REFUSED_SP[kind]), error
        assert "sequence_parallel: false" in error and "[the model was changed]" not in error, error
        assert ("audio frames" if kind == "whisper" else "image patches") in error, error
