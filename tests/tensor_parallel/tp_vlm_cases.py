"""Tensor-parallel cases for multimodal, vision and speech models (run on every rank of a
RankPool; each returns plain data). Tiny configs: LLaVA is a 2-layer Llama text model (hidden 64,
4 heads / 2 key-value heads, vocab 256) behind a 2-layer CLIP vision tower (hidden 32, 4 heads)
on 16x16 images of 8x8 patches (4 image tokens per image); ViT, DINOv2, CLIP and SigLIP use that
vision shape (CLIP / SigLIP with a 2-layer text tower of the same width), Whisper 2 encoder and 2
decoder layers of width 32 on 8 mel bins x 32 frames; dropout 0 so that runs are
deterministic."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import smp
from smp.testing.distributed import full_tensor, local_rows, world_mean
from tests.tensor_parallel.tp_vocabulary_cases import applied_plan

GLOBAL_BATCH, SEQ, VOCAB, IMAGE_TOKEN = 4, 16, 256, 255
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, head_dim=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=8, num_channels=3, attention_dropout=0.0)
IMAGE_TOKENS = (16 // 8) ** 2
SMALL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=16, attention_dropout=0.0)
WHISPER = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, num_mel_bins=8, max_source_positions=16,
               max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
VISION_FAMILIES = ("vit", "dinov2", "clip", "siglip", "whisper")  # split by smp's table


def build(kind: str) -> nn.Module:
    import transformers as T

    if kind == "llava":
        return T.LlavaForConditionalGeneration(T.LlavaConfig(
            text_config=T.LlamaConfig(**TEXT), vision_config=T.CLIPVisionConfig(**VISION, projection_dim=32),
            image_token_id=IMAGE_TOKEN, vision_feature_layer=-1, projector_hidden_act="gelu"))
    if kind == "gemma3":  # SigLIP vision tower, split by smp's table
        return T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            text_config=T.Gemma3TextConfig(**TEXT, sliding_window=16), vision_config=T.SiglipVisionConfig(**VISION),
            mm_tokens_per_image=IMAGE_TOKENS, image_token_index=IMAGE_TOKEN, boi_token_index=253, eoi_token_index=254))
    if kind == "paligemma":
        return T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
            text_config=T.GemmaConfig(**TEXT), vision_config=T.SiglipVisionConfig(**VISION, projection_dim=64),
            image_token_index=IMAGE_TOKEN, projection_dim=64, hidden_size=64))
    if kind == "vit":
        return T.ViTForImageClassification(T.ViTConfig(**VISION, num_labels=3, hidden_dropout_prob=0.0,
                                                       attention_probs_dropout_prob=0.0))
    if kind == "dinov2":
        return T.Dinov2ForImageClassification(T.Dinov2Config(**VISION, num_labels=3, hidden_dropout_prob=0.0,
                                                             attention_probs_dropout_prob=0.0))
    if kind == "clip":
        return T.CLIPModel(T.CLIPConfig(text_config=SMALL_TEXT, vision_config=VISION, projection_dim=16))
    if kind == "siglip":
        return T.SiglipModel(T.SiglipConfig(text_config=SMALL_TEXT, vision_config=VISION))
    if kind == "whisper":
        return T.WhisperForConditionalGeneration(T.WhisperConfig(**WHISPER))
    if kind == "mllama":  # a tower of local and global layers; cross-attention decoder layer 1
        model = T.MllamaForConditionalGeneration(T.MllamaConfig(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, cross_attention_layers=[1],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=4, image_size=16, patch_size=8, max_num_tiles=2,
                               vision_output_dim=64, intermediate_layers_indices=[0],
                               supported_aspect_ratios=[[1, 1], [1, 2]]),
            image_token_index=IMAGE_TOKEN))
        # Its tanh gates start at 0, which shuts the image path (and the tower's gradients) off:
        # opened, the comparison sees the tower and the cross-attention.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("_gate", "gate_attn", "gate_ffn")):
                    p.fill_(1.0)
        return model
    raise ValueError(kind)


def batch_for(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """The global batch `kind`'s forward takes (with its loss's targets)."""
    if kind == "llava":
        return image_text_batch(seed)
    if kind in ("gemma3", "paligemma"):  # image tokens marked in token_type_ids too
        batch = image_text_batch(seed)
        return {**batch, "token_type_ids": (batch["input_ids"] == IMAGE_TOKEN).long()}
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g)
    if kind in ("vit", "dinov2"):
        return {"pixel_values": pixels, "labels": torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)}
    if kind in ("clip", "siglip"):
        ids = torch.randint(3, VOCAB, (GLOBAL_BATCH, 8), generator=g)
        return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}
    if kind == "whisper":
        features = torch.randn(GLOBAL_BATCH, WHISPER["num_mel_bins"], 2 * WHISPER["max_source_positions"], generator=g)
        return {"input_features": features, "labels": torch.randint(3, VOCAB, (GLOBAL_BATCH, 6), generator=g)}
    if kind == "mllama":  # one image of two 16x16 tiles (aspect ratio 1x2) per row, seen by every token
        ids = torch.randint(3, IMAGE_TOKEN - 1, (GLOBAL_BATCH, SEQ), generator=g)
        ids[:, 1] = IMAGE_TOKEN
        return {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
                "pixel_values": torch.randn(GLOBAL_BATCH, 1, 2, 3, 16, 16, generator=g),
                "aspect_ratio_ids": torch.full((GLOBAL_BATCH, 1), 2),
                "aspect_ratio_mask": torch.ones(GLOBAL_BATCH, 1, 2, dtype=torch.long),
                "cross_attention_mask": torch.ones(GLOBAL_BATCH, SEQ, 1, 2, dtype=torch.long)}
    raise ValueError(kind)


def image_text_batch(seed: int) -> dict[str, torch.Tensor]:
    """GLOBAL_BATCH rows of SEQ tokens, each with one image (its IMAGE_TOKENS placeholders across
    the middle of the sequence, so that both halves of a sequence-parallel split hold image
    features), the image's pixels, and labels that skip the image tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, IMAGE_TOKEN - 1, (GLOBAL_BATCH, SEQ), generator=g)
    start = (SEQ - IMAGE_TOKENS) // 2
    ids[:, start:start + IMAGE_TOKENS] = IMAGE_TOKEN
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    pixels = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels}


def _skip_one_all_reduce(model: nn.Module) -> None:
    """Mutation: the first row-wise layer returns its local partial sum as if it were the total."""
    name = next(n for n, style in model._smp_tp_plan.items() if style == "rowwise")
    module = model.get_submodule(name)

    def local_matmul(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        x = x.to_local() if isinstance(x, DTensor) else x
        return x @ module.weight.to_local().t()  # no all-reduce of the partial sums

    module._forward_hooks.clear()  # drop the TP input/output layout hooks
    module._forward_pre_hooks.clear()
    module.forward = local_matmul


def equivalence(config: dict, kind: str, steps: int = 3, flip_image: bool = False, corrupt: bool = False,
                dtype: torch.dtype = torch.float32) -> dict:
    """TP run of the model's plan vs one process on the same init and global batch over `steps`
    SGD steps (lr 0.1): the largest loss and per-parameter gradient gaps, and what smp applied.
    Negative controls: `flip_image`, rank 1's images flipped left to right; `corrupt`, one
    row-wise layer's partial sums left unsummed. `dtype`: the model's and the inputs' float type."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind).to(dtype)
        model = smp.transform(copy.deepcopy(reference))
        if corrupt:
            _skip_one_all_reduce(model)
        batch = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in batch_for(kind, seed=100).items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_params = dict(reference.named_parameters())
        report = {"loss_diff": 0.0, "grad_diffs": {}, "losses": []}
        for _ in range(steps):
            local = {k: local_rows(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            if flip_image and smp.state.rank == 1:
                local["pixel_values"] = local["pixel_values"].flip(-1)
            loss = model(**local).loss
            loss.backward()
            ref_loss = reference(**batch).loss
            ref_loss.backward()
            report["losses"].append(float(ref_loss))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
            for n, p in model.named_parameters():
                grad = torch.zeros(p.shape, dtype=dtype) if p.grad is None else full_tensor(p.grad)
                ref_grad = torch.zeros(p.shape, dtype=dtype) if ref_params[n].grad is None else ref_params[n].grad
                report["grad_diffs"][n] = max(report["grad_diffs"].get(n, 0.0), float((grad - ref_grad).abs().max()))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        report["grad_diff"] = max(report["grad_diffs"].values())
        return {**report, **applied_plan(model)}


def sequence_parallel_refusal(config: dict, kind: str) -> str:
    """`kind` transformed with `config` (sequence parallel on): the error each rank raises before
    the model is changed (its parameters still plain tensors), or ''."""
    with smp.session(config):
        model = build(kind)
        try:
            smp.transform(model)
        except smp.Error as e:
            untouched = not any(isinstance(p, DTensor) for p in model.parameters())
            return f"{type(e).__name__}: {e}" + ("" if untouched else " [the model was changed]")
        return ""
