"""Tensor-parallel cases for multimodal and vision models (run on every rank of a RankPool; each
returns plain data). Tiny configs: a 2-layer Llama text model (hidden 64, 4 heads / 2 key-value
heads, vocab 256) behind a 2-layer CLIP vision tower (hidden 32, 4 heads) on 16x16 images of
8x8 patches (4 image tokens per image); dropout 0 so that runs are deterministic."""

from __future__ import annotations

import copy

import torch
from torch import nn

import smp
from smp.testing.distributed import full_tensor, local_rows, world_mean
from tests.tp_vocabulary_cases import applied_plan

GLOBAL_BATCH, SEQ, VOCAB, IMAGE_TOKEN = 4, 16, 256, 255
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, head_dim=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=8, num_channels=3, attention_dropout=0.0)
IMAGE_TOKENS = (16 // 8) ** 2


def build(kind: str) -> nn.Module:
    import transformers as T

    if kind == "llava":
        return T.LlavaForConditionalGeneration(T.LlavaConfig(
            text_config=T.LlamaConfig(**TEXT), vision_config=T.CLIPVisionConfig(**VISION, projection_dim=32),
            image_token_id=IMAGE_TOKEN, vision_feature_layer=-1, projector_hidden_act="gelu"))
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


def equivalence(config: dict, kind: str, steps: int = 3, flip_image: bool = False) -> dict:
    """TP run of the model's own plan vs one process on the same init and global batch over
    `steps` SGD steps (lr 0.1): the largest loss and per-parameter gradient gaps, and what smp
    applied. `flip_image`: the negative control, rank 1's images flipped left to right."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference))
        batch = image_text_batch(seed=100)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_params = dict(reference.named_parameters())
        report = {"loss_diff": 0.0, "grad_diffs": {}, "losses": []}
        for _ in range(steps):
            local = {k: local_rows(v) for k, v in batch.items()}
            if flip_image and smp.state.rank == 1:
                local["pixel_values"] = local["pixel_values"].flip(-1)
            loss = model(**local).loss
            loss.backward()
            ref_loss = reference(**batch).loss
            ref_loss.backward()
            report["losses"].append(float(ref_loss))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
            for n, p in model.named_parameters():
                grad = torch.zeros(p.shape) if p.grad is None else full_tensor(p.grad)
                ref_grad = torch.zeros(p.shape) if ref_params[n].grad is None else ref_params[n].grad
                report["grad_diffs"][n] = max(report["grad_diffs"].get(n, 0.0), float((grad - ref_grad).abs().max()))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        report["grad_diff"] = max(report["grad_diffs"].values())
        return {**report, **applied_plan(model)}
