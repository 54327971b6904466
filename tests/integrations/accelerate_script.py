"""A plain accelerate training loop, in the shape of Hugging Face's `run_clm_no_trainer.py`, for
tests/integrations/test_accelerate.py. With `--smp` it adds exactly the three lines a user adds (`import smp`,
`smp.init(...)` after `Accelerator(...)`, `model = smp.transform(model)`); everything else is
accelerate's: prepare of model, optimizer, both loaders and the scheduler, accumulate, backward,
clip_grad_norm_, reduce, gather_for_metrics, save_state every k steps, load_state +
skip_first_batches on resume, unwrap_model(model).save_pretrained into the output_dir.

Writes (main process) `<out>/log.jsonl`: one record per optimizer step (loss averaged over the
data-parallel batch, grad norm, learning rate) and a final one (eval loss, probe loss).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from accelerate.utils import gather as gather_over_every_process
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator, get_scheduler

VOCAB, SEQ = 256, 16


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config)


def rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB // 4, (n, SEQ), generator=g)
    ids = (base + torch.arange(SEQ)) % VOCAB  # a little structure to learn
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def local_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The norm of the gradients this process holds (its shards only, under FSDP / TP)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.stack([(g.to_local() if hasattr(g, "to_local") else g).float().norm() for g in grads]).norm()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--smp", default=None, help="smp config as JSON: adds the three smp lines")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--checkpointing-steps", type=int, default=0)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--skip-model-in-prepare", action="store_true", help="negative control")
    p.add_argument("--seedable-sampler", action="store_true", help="accelerate's epoch-seeded shuffling")
    return p.parse_args()


def main() -> None:
    args = parse()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=args.seedable_sampler))
    if args.smp is not None:
        import smp

        smp.init(json.loads(args.smp))
    set_seed(0)
    os.makedirs(args.out, exist_ok=True)
    model = build_model()
    if args.smp is not None:
        model = smp.transform(model)

    train = DataLoader(rows(48, 1), shuffle=True, collate_fn=default_data_collator, batch_size=args.batch)
    evaluation = DataLoader(rows(7, 2), collate_fn=default_data_collator, batch_size=args.batch)  # ragged last batch
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3)
    # As run_clm_no_trainer sizes it: in batches of one process, before prepare shards the loader.
    steps_per_epoch = math.ceil(len(train) / args.grad_accum)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=2 * steps_per_epoch)
    if args.skip_model_in_prepare:
        optimizer, train, evaluation, scheduler = accelerator.prepare(optimizer, train, evaluation, scheduler)
    else:
        model, optimizer, train, evaluation, scheduler = accelerator.prepare(
            model, optimizer, train, evaluation, scheduler)

    completed, skip = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        completed = int(os.path.basename(os.path.normpath(args.resume_from)).replace("step_", ""))
        skip = completed * args.grad_accum
    log = []
    model.train()
    loader = accelerator.skip_first_batches(train, skip) if skip else train
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            local = local_grad_norm(model) if accelerator.sync_gradients else None  # (negative control)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step_loss = accelerator.reduce(loss.detach(), reduction="mean")
        if accelerator.sync_gradients:
            completed += 1
            log.append({"step": completed, "loss": float(step_loss), "grad_norm": float(norm),
                        "local_grad_norm": float(local), "lr": scheduler.get_last_lr()[0]})
            if args.checkpointing_steps and completed % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.out, f"step_{completed}"))
        if completed >= args.steps:
            break

    model.eval()
    losses, every_process_rows = [], 0
    for batch in evaluation:
        with torch.no_grad():
            loss = model(**batch).loss
        per_row = loss.repeat(batch["input_ids"].shape[0])
        every_process_rows += gather_over_every_process(per_row).numel()  # (negative control)
        losses.append(accelerator.gather_for_metrics(per_row))
    losses = torch.cat(losses)
    probe = rows(3, 3)
    with torch.no_grad():
        probe_loss = float(model(input_ids=torch.stack([r["input_ids"] for r in probe]),
                                 labels=torch.stack([r["labels"] for r in probe])).loss)
    log.append({"eval_loss": float(losses.mean()), "eval_rows": int(losses.numel()),
                "every_process_rows": every_process_rows, "probe_loss": probe_loss})

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.out, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        with open(os.path.join(args.out, "log.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
