"""Fine-tune a vision-language model (image + text -> text) with smp doing the parallelism.

With no arguments it runs a small real job on CPU: a tiny LLaVA built from its config (a
CLIP-style vision tower, a projector, a Llama language model; byte-level tokens), trained to
name the colour and shape of small generated pictures ("a red square"). A third of the rows
are text-only, in runs, so some steps give a rank no image at all: smp runs the vision tower on
a blank image there, adding exactly zero (docs/vision.md). At the end the model is exported as
a Hugging Face folder that `LlavaForConditionalGeneration.from_pretrained` loads.

    torchrun --standalone --nproc-per-node 2 examples/finetune_vlm.py
    torchrun --standalone --nproc-per-node 2 examples/finetune_vlm.py --freeze-tower
    torchrun --standalone --nproc-per-node 2 examples/finetune_vlm.py --pretrained out/vlm/hf

--pretrained loads a folder written by save_pretrained or export_hf straight into the sharded
model: the model is built on the meta device and `smp.transform(model, weights=folder)` shards
it without init; each rank reads only its shards from the folder.
"""

from __future__ import annotations

import argparse
import os

import torch

import smp

IMAGE_TOKEN, IMAGE_TOKENS, SEQ = 255, 4, 24  # a 16x16 image in 8x8 patches: 4 image tokens
COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0)}
SHAPES = ("square", "stripe", "dot")


def tiny_llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, head_dim=16)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=8, num_channels=3, projection_dim=32)
    return LlavaForConditionalGeneration(LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, vision_feature_layer=-1,
        projector_hidden_act="gelu"))


def picture(colour: str, shape: str) -> torch.Tensor:
    """A 16x16 picture: a coloured square, horizontal stripe or dot on black."""
    image = torch.zeros(3, 16, 16)
    area = {"square": (slice(3, 13), slice(3, 13)), "stripe": (slice(6, 10), slice(0, 16)),
            "dot": (slice(6, 10), slice(6, 10))}[shape]
    for channel, value in enumerate(COLOURS[colour]):
        image[channel][area] = value
    return image


def encode(text: str) -> list[int]:
    return list(text.encode("ascii"))


def example(index: int) -> dict:
    """Row `index` of the data set: image rows (image tokens, then the caption) and, one run of
    three rows in three, text-only rows (a sentence to continue), so that some steps give a rank
    no image. Only the answer is learned (labels -100 elsewhere)."""
    colour, shape = list(COLOURS)[index % len(COLOURS)], SHAPES[(index // len(COLOURS)) % len(SHAPES)]
    if (index // 3) % 3 == 2:
        prompt, answer, image = encode("colours: "), encode(f"{colour}, {shape}s."), None
    else:
        prompt, answer, image = [IMAGE_TOKEN] * IMAGE_TOKENS + encode("this is "), encode(f"a {colour} {shape}."), picture(colour, shape)
    ids = (prompt + answer + [ord(" ")] * SEQ)[:SEQ]
    labels = ([-100] * len(prompt) + answer + [-100] * SEQ)[:SEQ]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "image": image}


def collate(rows: list[dict]) -> dict:
    batch = {"input_ids": torch.stack([r["input_ids"] for r in rows]),
             "labels": torch.stack([r["labels"] for r in rows])}
    images = [r["image"] for r in rows if r["image"] is not None]
    if images:  # rows without an image carry no pixel_values at all
        batch["pixel_values"] = torch.stack(images)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--freeze-tower", action="store_true", help="train the projector and LM only")
    parser.add_argument("--pretrained", help="a save_pretrained / export_hf folder to start from")
    parser.add_argument("--output-dir", default="out/vlm")
    parser.add_argument("--no-export", action="store_true")
    args = parser.parse_args()

    with smp.session({}) as state:
        torch.manual_seed(0)
        if args.pretrained:  # meta model, sharded, then each rank reads its shards from the folder
            with torch.device("meta"):
                model = tiny_llava()
            model = smp.transform(model, weights=args.pretrained)
        else:
            model = tiny_llava()
            if args.freeze_tower:
                model.model.vision_tower.requires_grad_(False)
            model = smp.transform(model)
        if args.pretrained and args.freeze_tower:
            model.model.vision_tower.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        if args.global_batch % state.dp_size:
            raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the {state.dp_size} ranks")
        rows = args.global_batch // state.dp_size
        losses = []
        for step in range(1, args.steps + 1):
            first = (step - 1) * args.global_batch + state.dp_rank * rows
            batch = collate([example(i) for i in range(first, first + rows)])
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if state.rank == 0 and (step == 1 or step % 5 == 0):
                print(f"step {step:3d}  loss {losses[-1]:.4f}  images on rank 0: {len(batch.get('pixel_values', []))}", flush=True)
        if not args.no_export:
            out = smp.checkpointing.export_hf(os.path.join(args.output_dir, "hf"), model)
            if state.rank == 0:
                print(f"exported {out}", flush=True)
        if state.rank == 0:
            print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
