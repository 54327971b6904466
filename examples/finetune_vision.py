"""Train a vision model with smp doing the parallelism: ViT image classification, or CLIP
contrastive image-text training over the global batch.

With no arguments it runs a small real job on CPU: a tiny ViT built from its config learns to
tell the colour of small generated pictures (4 classes). `--task clip` trains a tiny CLIP to
match each picture with its caption; each rank embeds its own rows and
`smp.vision.clip_loss` gathers every rank's embeddings (with gradient) so that the loss has the
global batch's in-batch negatives, exactly the one-process loss (docs/vision.md). CLIP's 0-d
`logit_scale` stays whole on every rank, its gradient averaged.

    torchrun --standalone --nproc-per-node 2 examples/finetune_vision.py
    torchrun --standalone --nproc-per-node 2 examples/finetune_vision.py --task clip
"""

from __future__ import annotations

import argparse
import os

import torch

import smp
from smp.vision import clip_loss

COLOURS = ("red", "green", "blue", "yellow")
RGB = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0)}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=8, num_channels=3)


def build(task: str):
    import transformers as T

    if task == "classify":
        return T.ViTForImageClassification(T.ViTConfig(**VISION, num_labels=len(COLOURS)))
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=1)
    return T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=16))


def example(index: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(picture, label, caption tokens) of row `index`: a coloured patch at a varying place on
    noise, its colour's index, and "a <colour> patch" as bytes (padded to 16)."""
    g = torch.Generator().manual_seed(index)
    label = index % len(COLOURS)
    image = 0.2 * torch.rand(3, 16, 16, generator=g)
    y, x = (int(v) for v in torch.randint(0, 9, (2,), generator=g))
    for channel, value in enumerate(RGB[COLOURS[label]]):
        image[channel, y:y + 8, x:x + 8] += value
    caption = list(f"a {COLOURS[label]} patch".encode("ascii"))
    return image, label, torch.tensor((caption + [1] * 16)[:16])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("classify", "clip"), default="classify")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="out/vision")
    parser.add_argument("--no-export", action="store_true")
    args = parser.parse_args()

    with smp.session({}) as state:
        torch.manual_seed(0)
        model = smp.transform(build(args.task))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if args.global_batch % state.dp_size:
            raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the {state.dp_size} ranks")
        rows = args.global_batch // state.dp_size
        losses = []
        for step in range(1, args.steps + 1):
            first = (step - 1) * args.global_batch + state.dp_rank * rows
            images, labels, captions = zip(*(example(i) for i in range(first, first + rows)))
            pixels = torch.stack(images)
            if args.task == "classify":
                out = model(pixel_values=pixels, labels=torch.tensor(labels))
                loss = out.loss
                note = f"accuracy {float((out.logits.argmax(-1) == torch.tensor(labels)).float().mean()):.2f}"
            else:  # the global batch's contrastive loss: every rank's embeddings, with gradient
                out = model(input_ids=torch.stack(captions), pixel_values=pixels)
                loss = clip_loss(out.image_embeds, out.text_embeds, model.logit_scale)
                note = f"logit_scale {float(model.logit_scale.detach()):.3f}"
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if state.rank == 0 and (step == 1 or step % 5 == 0):
                print(f"step {step:3d}  loss {losses[-1]:.4f}  {note}", flush=True)
        if not args.no_export:
            out_dir = smp.checkpointing.export_hf(os.path.join(args.output_dir, args.task), model)
            if state.rank == 0:
                print(f"exported {out_dir}", flush=True)
        if state.rank == 0:
            print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
