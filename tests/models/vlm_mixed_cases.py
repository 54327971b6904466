"""Rank-side cases for batches where some ranks hold no image, on the image-text families beyond
LLaVA and Qwen2.5-VL (tests/models/test_vlm.py): tiny Gemma3, PaliGemma, Idefics3, SmolVLM, Qwen2-VL,
VipLLaVA, Aya Vision, InternVL and GOT-OCR2 built from transformers configs, and Mistral3 (its
tower needs each image's size) and Pix2Struct (images as flattened patches): refused. Each function returns plain data to the test."""

from __future__ import annotations

import copy
import importlib

import torch
import torch.distributed as dist

import smp
from tests.models import vlm_cases
from tests.models.vlm_cases import TEXT, VISION
from tests import REPO_ROOT

ROWS, SEQ = 2, 12  # rows per rank, tokens per row
IMAGE_TOKEN = 255
MIXED_FAMILIES = ("gemma3", "paligemma", "idefics3", "smolvlm", "qwen2_vl", "vipllava", "aya_vision", "internvl",
                  "got_ocr2")
# Image tokens per image: 16x16 images in 8x8 patches give 4 patches, which Aya Vision's pixel
# shuffle and InternVL's downsampling merge into one token; GOT-OCR2's 64x64 image, one token.
IMAGE_TOKENS = {"aya_vision": 1, "internvl": 1, "got_ocr2": 1}


def build(family: str) -> torch.nn.Module:
    """The tiny `family` model (vlm_cases' builders, plus Idefics3 and SmolVLM)."""
    import transformers as T

    llama = T.LlamaConfig(**TEXT)
    if family == "qwen2_vl":
        text = {k: v for k, v in TEXT.items() if k != "head_dim"}
        return T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            text_config=dict(**text, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
                             bos_token_id=0, eos_token_id=1),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                               spatial_merge_size=2, temporal_patch_size=2),
            image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=252))
    if family == "vipllava":
        return T.VipLlavaForConditionalGeneration(T.VipLlavaConfig(
            text_config=llama, vision_config=T.CLIPVisionConfig(**VISION), image_token_index=IMAGE_TOKEN,
            vision_feature_layers=[-2, -1]))
    if family == "aya_vision":
        return T.AyaVisionForConditionalGeneration(T.AyaVisionConfig(
            text_config=llama, vision_config=T.SiglipVisionConfig(**VISION), image_token_index=IMAGE_TOKEN,
            downsample_factor=2, vision_feature_layer=-1))
    if family == "internvl":
        return T.InternVLForConditionalGeneration(T.InternVLConfig(
            text_config=llama, image_token_id=IMAGE_TOKEN, downsample_ratio=0.5, vision_feature_layer=-1,
            vision_config=T.InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=[16, 16], patch_size=[8, 8])))
    if family == "got_ocr2":
        return T.GotOcr2ForConditionalGeneration(T.GotOcr2Config(
            text_config=T.Qwen2Config(**TEXT), image_token_index=IMAGE_TOKEN,
            vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4,
                               image_size=64, patch_size=16, mlp_dim=64, global_attn_indexes=[1], window_size=2)))
    if family == "mistral3":
        return T.Mistral3ForConditionalGeneration(T.Mistral3Config(
            text_config=T.MistralConfig(**TEXT), image_token_index=IMAGE_TOKEN, spatial_merge_size=1,
            vision_feature_layer=-1,
            vision_config=T.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, image_size=16, patch_size=8, head_dim=8)))
    if family == "pix2struct":  # images come as flattened patches (row, column, 12 values each)
        return T.Pix2StructForConditionalGeneration(T.Pix2StructConfig(
            text_config=dict(hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=256),
            vision_config=dict(hidden_size=32, d_kv=8, d_ff=64, num_hidden_layers=2, num_attention_heads=4,
                               patch_embed_hidden_size=12, seq_len=8)))
    if family == "idefics3":
        return T.Idefics3ForConditionalGeneration(T.Idefics3Config(
            text_config=T.LlamaConfig(**TEXT), image_token_id=IMAGE_TOKEN, scale_factor=1,
            vision_config=T.Idefics3VisionConfig(**VISION)))
    if family == "smolvlm":
        return T.SmolVLMForConditionalGeneration(T.SmolVLMConfig(
            text_config=T.LlamaConfig(**TEXT), image_token_id=IMAGE_TOKEN, scale_factor=1,
            vision_config=T.SmolVLMVisionConfig(**VISION)))
    return vlm_cases.build(family)


def rows(family: str, rank: int, with_images: bool) -> dict:
    """Rank `rank`'s rows of the global batch: each row one 16x16 image (4 image tokens: 8x8
    patches) then text, or text-only rows; the same on every call (seeded by rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, 240, (ROWS, SEQ), generator=g)
    if family == "pix2struct":  # an encoder-decoder: the text is the decoder's
        patches = torch.cat([torch.ones(ROWS, 8, 2), torch.randn(ROWS, 8, 12, generator=g)], -1)
        return {"decoder_input_ids": ids, **({"flattened_patches": patches} if with_images else {})}
    batch = {"input_ids": ids}
    if family in ("gemma3", "paligemma"):  # the image rows attend bidirectionally: token types
        batch["token_type_ids"] = torch.zeros_like(ids)
    if family == "qwen2_vl":  # multimodal rotary positions: which tokens are image tokens
        batch["mm_token_type_ids"] = torch.zeros_like(ids)
    if not with_images:
        return batch
    tokens = IMAGE_TOKENS.get(family, 4)
    ids[:, 1:1 + tokens] = IMAGE_TOKEN
    pixels = torch.randn(ROWS, 3, 16, 16, generator=g)
    if family in ("gemma3", "paligemma"):
        batch["token_type_ids"][:, 1:5] = 1
        batch["pixel_values"] = pixels
    elif family in ("idefics3", "smolvlm"):  # (rows, images per row, channels, height, width)
        batch["pixel_values"] = pixels[:, None]
        batch["pixel_attention_mask"] = torch.ones(ROWS, 1, 16, 16, dtype=torch.bool)
    elif family == "qwen2_vl":  # 16x16 image: 4x4 patches of 4, merged 2x2: 4 image tokens
        ids[:, 0] = 252
        batch["pixel_values"] = torch.randn(ROWS * 16, 3 * 2 * 4 * 4, generator=g)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * ROWS)
        batch["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
    elif family == "got_ocr2":
        batch["pixel_values"] = torch.randn(ROWS, 3, 64, 64, generator=g)
    elif family == "mistral3":
        batch["pixel_values"] = pixels
        batch["image_sizes"] = torch.tensor([[16, 16]] * ROWS)
    else:
        batch["pixel_values"] = pixels
    return batch


def global_batch(family: str, image_ranks: tuple[int, ...], world: int) -> dict:
    """Every rank's rows, concatenated in rank order: the one-process run's batch."""
    parts = [rows(family, r, r in image_ranks) for r in range(world)]
    return {key: torch.cat([p[key] for p in parts if key in p])
            for key in dict.fromkeys(k for p in parts for k in p)}


def labels_of(family: str, batch: dict) -> torch.Tensor:
    """The language-model labels: the input ids, every token counted (so each rank's mean loss
    is over as many tokens as every other's, and their mean is the global batch's loss)."""
    return batch["input_ids"]


def mixed_batch(config: dict, family: str, image_ranks: tuple[int, ...] = (0,), steps: int = 3,
                run_tower_everywhere: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """`family` transformed at world 2 on a global batch where only `image_ranks` hold images,
    vs the same model in one process on the whole batch: {"loss_diff", "grad_diff", "losses",
    "tower_grad"} over `steps` SGD steps. `run_tower_everywhere=False` (negative control, run in
    a subprocess: gloo aborts the process) turns smp's fix off."""
    recipe = importlib.import_module("smp.transform")  # the module (smp.transform is the function)
    from smp.testing.distributed import world_mean

    original = recipe.install_image_path_on_every_rank
    if not run_tower_everywhere:
        recipe.install_image_path_on_every_rank = lambda model, groups: []
    try:
        with smp.session(config):
            torch.manual_seed(0)
            reference = build(family).to(dtype)
            model = smp.transform(copy.deepcopy(reference))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            rank, world = dist.get_rank(), dist.get_world_size()
            local = _cast(rows(family, rank, rank in image_ranks), dtype)
            whole = _cast(global_batch(family, image_ranks, world), dtype)
            report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "tower_grad": 0.0}
            for _ in range(steps):
                loss = model(**local, labels=labels_of(family, local)).loss
                loss.backward()
                ref_loss = reference(**whole, labels=labels_of(family, whole)).loss
                ref_loss.backward()
                report["losses"].append(float(ref_loss.detach()))
                report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss.detach()) - float(ref_loss.detach())))
                report["grad_diff"] = max(report["grad_diff"], vlm_cases._grad_gap(model, reference))
                report["tower_grad"] = max([report["tower_grad"], *(
                    float(p.grad.abs().max()) for n, p in reference.named_parameters()
                    if p.grad is not None and ("vision" in n or "visual" in n))])
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
            return report
    finally:
        recipe.install_image_path_on_every_rank = original


def _cast(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def mixed_batch_every_output_summed(config: dict, family: str) -> dict:
    """`mixed_batch` with the blank run summing every tensor `get_image_features` returns (the
    tower's raw hidden states and pooled output too), not only the image features the forward
    uses (negative control, run in a subprocess: the extra gradients make FSDP's reduce-scatter
    sizes differ between ranks and gloo aborts the process)."""
    from smp.vision import mixed_batches

    original = mixed_batches._features_sum
    mixed_batches._features_sum = mixed_batches._float_sum
    try:
        return mixed_batch(config, family, steps=1)
    finally:
        mixed_batches._features_sum = original


def in_subprocess(case: str, timeout: float = 150.0, **kwargs) -> dict:
    """Run this module's `case(**kwargs)` in a fresh 2-rank pool inside a subprocess (a
    collective mismatch aborts the processes): {"returncode", "tail"}."""
    import os
    import subprocess
    import sys

    code = (
        "from smp.testing.rank_pool import RankPool\n"
        "from tests.models import vlm_mixed_cases\n"
        "pool = RankPool(2)\n"
        "try:\n"
        f"    print('RESULT', pool.run(vlm_mixed_cases.{case}, timeout={timeout - 60}, **{kwargs!r}))\n"
        "finally:\n"
        "    pool.close(force=True)\n"
    )
    root = str(REPO_ROOT)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"returncode": None, "tail": f"timed out: {(e.stdout or '')[-500:]}"}
    return {"returncode": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}


def mixed_batch_refused(config: dict, family: str) -> str:
    """`family` with images on rank 0 only, where smp's blank-image run is not proven: the error
    each rank raises before the forward runs, or ''."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build(family))
        batch = rows(family, dist.get_rank(), dist.get_rank() == 0)
        try:
            model(**batch)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""


# --- gradient clipping on a model with a 0-d parameter (CLIP's logit_scale) -------------------

def clip_with_scalar(family: str = "clip", clip: str = "torch", steps: int = 3, average: bool = True,
                     max_norm: float = 0.05) -> dict:
    """A model with a 0-d parameter kept whole by smp at world 2, each rank its 2 rows of a
    4-row batch: "clip" (logit_scale; the loss over the global batch, smp.vision.clip_loss) or
    "scaled" (vlm_cases._Scaled: each rank's loss over its own rows, so the 0-d gradients
    differ between ranks until averaged). Gradients clipped by `clip` ("torch":
    torch.nn.utils.clip_grad_norm_ as users and the Trainer call it; "smp": smp.clip_grad_norm_)
    vs torch's clip on the model in one process: {"norm_diff" (relative), "norms", "grad_diff",
    "scale_grad_diff"} over `steps` SGD steps. `average=False` (negative control) leaves the 0-d
    gradient each rank's own."""
    from smp.sharding import fsdp
    from smp.testing.distributed import full_tensor
    from smp.vision import contrastive as losses

    original = fsdp.average_scalar_gradients
    if not average:
        fsdp.average_scalar_gradients = lambda params, mesh: None
    try:
        with smp.session({}):
            torch.manual_seed(0)
            reference = vlm_cases._Scaled() if family == "scaled" else build(family)
            model = smp.transform(copy.deepcopy(reference))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(5)
            ids, pixels = torch.randint(3, 250, (4, 8), generator=g), torch.randn(4, 3, 16, 16, generator=g)
            inputs = torch.randn(4, 8, generator=g)
            mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
            report = {"norm_diff": 0.0, "norms": [], "grad_diff": 0.0, "scale_grad_diff": 0.0}
            scalar = "scale" if family == "scaled" else "logit_scale"
            for _ in range(steps):
                if family == "scaled":
                    model(inputs[mine]).backward()
                    reference(inputs).backward()
                else:
                    out = model(input_ids=ids[mine], pixel_values=pixels[mine])
                    losses.clip_loss(out.image_embeds, out.text_embeds, model.logit_scale).backward()
                    reference(input_ids=ids, pixel_values=pixels, return_loss=True).loss.backward()
                if clip == "torch":
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                else:
                    norm = smp.clip_grad_norm_(model, max_norm)
                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
                norm = float(full_tensor(norm))
                report["norms"].append((norm, float(ref_norm)))
                report["norm_diff"] = max(report["norm_diff"], abs(norm - float(ref_norm)) / float(ref_norm))
                report["grad_diff"] = max(report["grad_diff"], vlm_cases._grad_gap(model, reference))
                report["scale_grad_diff"] = max(report["scale_grad_diff"], float(
                    (full_tensor(getattr(model, scalar).grad) - getattr(reference, scalar).grad).abs()))
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
            return report
    finally:
        fsdp.average_scalar_gradients = original


# --- SMPTrainer.save_model on tied input/output embeddings -------------------------------------

def trainer_save_tied(family: str = "llama-tied", keep_both: bool = False, steps: int = 2) -> dict:
    """`family` (tied embeddings) trained `steps` steps by SMPTrainer at world 2, then
    `trainer.save_model(folder)` and transformers' `from_pretrained` of the folder (rank 0):
    {"error", "diff" (every tensor vs the trained sharded model; 0.0 is bitwise), "tied", "files"}.
    `keep_both` (negative control) writes both names of the tied weight, as export_hf did before."""
    import os
    import shutil

    from smp.checkpointing.hf import export as hf_export
    from smp.integrations import SMPTrainer
    from smp.testing.distributed import full_tensor
    from tests.integrations import trainer_cases

    out = vlm_cases._shared_dir(f"trainer-tied-{family}-")
    original = hf_export.one_copy_of_tied
    if keep_both:
        hf_export.one_copy_of_tied = lambda state, model: state
    try:
        with smp.session({}):
            torch.manual_seed(0)
            model = vlm_cases.build(family)
            args = trainer_cases.training_args(os.path.join(out, "run"), smp.state.dp_size, steps=steps)
            trainer = SMPTrainer(model=model, args=args, train_dataset=trainer_cases.TokenRows(), smp_config={})
            trainer.train()
            expected = {n: full_tensor(t.detach()).clone() for n, t in trainer.model.state_dict().items()}
            folder = os.path.join(out, "final")
            try:
                trainer.save_model(folder)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                return {"error": f"{type(e).__name__}: {e}"}
            if dist.get_rank() != 0:
                return {"error": "", "diff": 0.0, "tied": True, "files": []}
            loaded = type(vlm_cases.build(family)).from_pretrained(folder)
            state = loaded.state_dict()
            diff = 0.0
            for name, value in expected.items():
                same = name in state and torch.equal(state[name], value)
                diff = max(diff, 0.0 if same else float((state[name].double() - value.double()).abs().max())
                           if name in state else float("inf"))
            tied = loaded.get_input_embeddings().weight.data_ptr() == loaded.get_output_embeddings().weight.data_ptr()
            return {"error": "", "diff": diff, "tied": tied, "files": sorted(os.listdir(folder))}
    finally:
        hf_export.one_copy_of_tied = original
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
