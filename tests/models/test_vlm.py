"""Vision and multimodal models (and the tied-embedding text models they share a path with):
pretrained weights in and out (`export_hf`, `load_hf` through transformers' own key
conversion, a meta model loaded from a folder), each proven against transformers'
`from_pretrained` or one process, each with a negative control beside it."""

from __future__ import annotations

import pytest

from tests.models import vlm_cases as cases
from tests.models import vlm_mixed_cases as mixed


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


PRETRAINED = ("llava", "qwen2_5_vl", "gemma3", "paligemma", "mllama", "vit", "dinov2", "clip", "siglip")


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


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_transform_with_weights_is_one_call(ranks, family):
    """`smp.transform(meta_model, weights=folder)`: the same result as transform(materialize=False)
    + load_hf, bitwise equal to from_pretrained + transform."""
    for r in ranks(2).run(cases.meta_load, config={}, family=family, one_call=True, timeout=240):
        assert r["error"] == "" and r["diff"] == 0.0 and r["buffers"], r


def test_meta_model_buffers_left_empty_are_caught(ranks):
    """Negative control: non-persistent buffers left as to_empty memory (the rotary inv_freq of
    a meta Llama) are caught by the comparison."""
    results = ranks(2).run(cases.meta_load, config={}, family="llama-tied", compute_buffers=False, timeout=240)
    assert any(r["diff"] > 0.0 for r in results), results


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_rank_without_images_is_exact(ranks, family):
    """Rank 0's rows hold images, rank 1's are text-only: the vision tower runs on both ranks
    (a blank image contributing exactly zero on rank 1), 3 SGD steps, loss and every gradient
    within 1e-5 of one process on the whole batch; the tower is trained (non-zero gradients)."""
    for r in ranks(2).run(cases.mixed_batch, config={}, family=family, timeout=300):
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5 and r["tower_grad"] > 0, r
        assert r["losses"][-1] < r["losses"][0], r


def test_every_rank_with_images_is_exact(ranks):
    """Control of the control: both ranks hold images (no blank image run anywhere)."""
    for r in ranks(2).run(cases.mixed_batch, config={}, family="llava", image_ranks=(0, 1), steps=1, timeout=300):
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r


def test_rank_without_images_unfixed_aborts():
    """Negative control: without smp's fix the text-only rank skips the tower's FSDP units and
    gloo aborts on the collective mismatch (run in a subprocess: the process dies)."""
    r = cases.mixed_batch_in_subprocess("llava")
    assert r["returncode"] != 0, r
    assert "mismatch" in r["tail"] or "died" in r["tail"] or "timed out" in r["tail"], r


@pytest.mark.parametrize("family", mixed.MIXED_FAMILIES)
def test_rank_without_images_is_exact_on_every_proven_family(ranks, family):
    """The same on Gemma3, PaliGemma, Idefics3, SmolVLM, Qwen2-VL, VipLLaVA, Aya Vision, InternVL
    and GOT-OCR2 (smp.vision.mixed_batches.PROVEN): rank 1 text-only, 3 SGD steps, loss and
    every gradient within 1e-5 of one process, the tower trained."""
    for r in ranks(2).run(mixed.mixed_batch, config={}, family=family, timeout=300):
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5 and r["tower_grad"] > 0, r
        assert r["losses"][-1] < r["losses"][0], r


def test_blank_run_summing_every_tower_output_aborts():
    """Negative control: a blank run that sums every tensor get_image_features returns (Aya
    Vision's raw tower outputs too, not only the features the forward uses) gives parameters a
    gradient on the text-only rank only; FSDP's reduce-scatter sizes then differ and gloo
    aborts (in a subprocess: the process dies). Hence PROVEN, not every model with the method."""
    r = mixed.in_subprocess("mixed_batch_every_output_summed", config={}, family="aya_vision")
    assert r["returncode"] != 0 and "mismatch" in r["tail"], r


@pytest.mark.parametrize("family,model,modules", [("mistral3", "Mistral3Model", "vision_tower"),
                                                   ("pix2struct", "Pix2StructForConditionalGeneration", "image encoder")])
def test_mixed_batch_on_an_unproven_family_is_refused_on_every_rank(ranks, family, model, modules):
    """Mistral3 (not in PROVEN: its tower takes each image's size) and Pix2Struct (no
    get_image_features; images as flattened patches) with images on rank 0 only: every rank
    raises naming the model, its image modules and the proven list."""
    for error in ranks(2).run(mixed.mixed_batch_refused, config={}, family=family, timeout=300):
        assert error.startswith("ConfigError") and f"({model})" in error, error
        assert modules in error and "proven exact only on" in error, error


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_contrastive_loss_over_the_global_batch(ranks, family):
    """Each rank embeds its own rows; smp.vision's gathered loss equals the model's own loss on
    the whole batch in one process, and so do every gradient (CLIP's 0-d logit_scale kept whole,
    its gradient averaged), 3 SGD steps within 1e-5."""
    for r in ranks(2).run(cases.contrastive, config={}, family=family, timeout=300):
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r
        assert r["losses"][-1] < r["losses"][0], r
    if family == "clip":
        assert r["scalar_is_0d"], "the model's shapes are unchanged: export_hf still loads in from_pretrained"


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_contrastive_loss_without_gather_is_caught(ranks, family):
    """Negative control: each rank's loss over its own rows only (fewer in-batch negatives)."""
    for r in ranks(2).run(cases.contrastive, config={}, family=family, gather=False, steps=1, timeout=300):
        assert r["loss_diff"] > 1e-2, r


def test_scalar_parameter_kept_whole_gradient_averaged(ranks):
    """A 0-d parameter (fully_shard refuses it) stays whole on every rank with its shape, and
    its gradient is averaged over the ranks: 3 SGD steps within 1e-5 of one process."""
    for r in ranks(2).run(cases.scalar_parameter, timeout=300):
        assert r["scalar_is_0d"] and r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r


def test_scalar_parameter_gradient_not_averaged_is_caught(ranks):
    """Negative control: each rank's own gradient of the 0-d parameter."""
    for r in ranks(2).run(cases.scalar_parameter, average=False, steps=1, timeout=300):
        assert r["scale_grad_diff"] > 1e-3, r


def _tiny_idefics3():
    import transformers as T

    return T.Idefics3ForConditionalGeneration(T.Idefics3Config(
        text_config=T.LlamaConfig(**cases.TEXT), image_token_id=255, scale_factor=1,
        vision_config=T.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=16, patch_size=8)))


def test_block_discovery_takes_the_repeated_layer():
    """Idefics3 (and SmolVLM) list only their vision attention in _no_split_modules: the FSDP
    unit is the repeated layer holding it (the ModuleList element), so the vision MLPs and
    norms leave the always-gathered root; root_modules names what stays there."""
    from smp.sharding import find_blocks
    from smp.sharding.blocks import root_modules

    model = _tiny_idefics3()
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["Idefics3EncoderLayer"] * 2 + ["LlamaDecoderLayer"] * 2
    names, share = root_modules(model, blocks)
    assert not any(".mlp" in n or "layer_norm" in n for n in names), names
    assert "lm_head" in names and "model.text_model.embed_tokens" in names and 0 < share < 0.35


def test_attention_only_units_are_caught(monkeypatch):
    """Negative control: without the promotion the attention is the unit and root_modules shows
    each vision layer's MLP and norms left in the root."""
    from smp import anatomy
    from smp.sharding import blocks as blocks_module

    monkeypatch.setattr(anatomy, "_repeated_layers", lambda model, found: found)
    model = _tiny_idefics3()
    found = blocks_module.find_blocks(model)
    names, share = blocks_module.root_modules(model, found)
    assert "Idefics3VisionAttention" in [type(b).__name__ for b in found]
    assert any(".mlp" in n for n in names) and share > 0.35, (names, share)


AC_OFFLOAD = {"activation_checkpointing": "full", "sm_activation_offloading": True, "activation_offload_min_bytes": 0}


def test_frozen_tower_is_not_offloaded(ranks):
    """A frozen vision tower on inputs that need no gradient: backward never runs through its
    blocks, so the offloader moves none of their activations (the language model's still go),
    and the run stays exact vs one process (3 SGD steps, 1e-5)."""
    for r in ranks(2).run(cases.mixed_batch, config=AC_OFFLOAD, family="llava", image_ranks=(0, 1),
                          freeze_tower=True, timeout=300):
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5 and r["tower_grad"] == 0.0, r
        assert r["tower_blocks"] > 0 and r["tower_offloaded"] == 0 and r["other_offloaded"] > 0, r


def test_frozen_tower_offloaded_without_the_check_is_caught(ranks):
    """Negative control: with the check off (every block counted as needing gradients) the
    frozen tower's blocks are offloaded, which the test above would catch."""
    for r in ranks(2).run(cases.frozen_tower_offloaded_anyway, config=AC_OFFLOAD, timeout=300):
        assert r["tower_offloaded"] > 0, r


def test_mixed_batch_smp_cannot_run_is_refused_on_every_rank(ranks):
    """Mllama's tower needs more than pixels (aspect ratios, tile masks): with images on one rank
    only, every rank raises naming the model before any collective diverges."""
    for error in ranks(2).run(cases.mixed_batch_refused, config={}, timeout=300):
        assert error.startswith("ConfigError") and "(MllamaForConditionalGeneration)" in error, error
        assert "model.vision_model" in error, error


@pytest.mark.parametrize("clip", ["torch", "smp"])
@pytest.mark.parametrize("family", ["clip", "scaled"])
def test_clip_grad_norm_with_a_scalar_parameter(ranks, family, clip):
    """torch.nn.utils.clip_grad_norm_ (as users and the Trainer call it) and smp.clip_grad_norm_
    on a model with a 0-d parameter kept whole (CLIP's logit_scale; a toy whose 0-d gradient
    differs per rank before averaging) at FSDP world 2: the same total norm (relative 1e-5)
    and clipped gradients (1e-5) as torch's clip in one process, 3 SGD steps."""
    for r in ranks(2).run(mixed.clip_with_scalar, family=family, clip=clip, timeout=300):
        assert r["norm_diff"] < 1e-5 and r["grad_diff"] < 1e-5 and r["scale_grad_diff"] < 1e-5, r
        assert all(ref > 0.05 for _, ref in r["norms"]), r  # max_norm 0.05: every step clips


@pytest.mark.parametrize("clip", ["torch", "smp"])
def test_clip_grad_norm_with_scalar_gradient_not_averaged_is_caught(ranks, clip):
    """Negative control: the 0-d gradient left each rank's own: the norm or the clipped
    gradients differ from one process."""
    for r in ranks(2).run(mixed.clip_with_scalar, family="scaled", clip=clip, average=False, steps=1, timeout=300):
        assert r["norm_diff"] > 1e-4 and r["scale_grad_diff"] > 1e-4, r


def test_trainer_save_model_with_tied_embeddings_loads_bitwise(ranks):
    """SMPTrainer.save_model on a Llama with tie_word_embeddings=True, trained 2 steps at FSDP
    world 2: from_pretrained of the folder holds every tensor bitwise equal to the trained
    model, the tie restored."""
    for r in ranks(2).run(mixed.trainer_save_tied, timeout=300):
        assert r["error"] == "" and r["diff"] == 0.0 and r["tied"], r


def test_trainer_save_model_writing_both_tied_names_is_refused(ranks):
    """Negative control: both names of the tied weight written (as export_hf did before)."""
    for r in ranks(2).run(mixed.trainer_save_tied, keep_both=True, steps=1, timeout=300):
        assert "share memory" in r["error"], r["error"][-300:]
