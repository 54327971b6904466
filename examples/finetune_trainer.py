"""A transformers `Trainer` script with smp doing the parallelism: the only change from a plain
Trainer script is `SMPTrainer(..., smp_config=...)` in place of `Trainer(...)`.

With no arguments it trains a tiny Llama (built from its config, random init) on byte tokens of
English documentation that ships with Python, on CPU:

    torchrun --standalone --nproc-per-node 2 examples/finetune_trainer.py
    torchrun --standalone --nproc-per-node 4 examples/finetune_trainer.py --config examples/configs/hybrid.yaml
    torchrun --standalone --nproc-per-node 2 examples/finetune_trainer.py --resume      # from the last checkpoint
    torchrun --standalone --nproc-per-node 8 examples/finetune_trainer.py --model /path/to/hf_model

--model takes a local folder saved by save_pretrained (its weights and tokenizer are used).
Outputs under --output-dir: checkpoint-N/ (smp sharded checkpoints, every --save-steps) and
final/ (a safetensors folder that AutoModelForCausalLM.from_pretrained loads).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from smp.integrations import SMPTrainer
from smp.models import build_causal_lm, resolve_model_config


def builtin_text() -> str:
    """Documentation every Python installation carries: no download needed."""
    import argparse as a, collections, csv, functools, json, logging, pathlib, re  # noqa: E401

    docs = [getattr(obj, "__doc__", None) for m in (a, collections, csv, functools, json, logging, pathlib, re)
            for obj in (m, *vars(m).values())]
    return "\n\n".join(dict.fromkeys(d for d in docs if isinstance(d, str) and len(d) > 200))


class PackedRows(Dataset):
    """Token ids packed into fixed-length rows (labels = inputs; the model shifts them)."""

    def __init__(self, ids: list[int], seq_len: int):
        rows = len(ids) // seq_len
        self.rows = torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def load_model_and_ids(spec: str | None, text: str, seq_len: int):
    """(model, token ids): a local model folder with its tokenizer, or a tiny Llama on bytes."""
    if spec is None:
        model = build_causal_lm(resolve_model_config("tiny", max_position_embeddings=max(128, seq_len)))
        return model, list(text.encode("utf-8"))
    model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    return model, tokenizer(text)["input_ids"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="smp config (YAML/JSON); default: $SMP_CONFIG or smp's defaults")
    p.add_argument("--model", default=None, help="a local save_pretrained folder; default: a tiny Llama")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--output-dir", default="runs/trainer")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    args = p.parse_args()

    torch.manual_seed(0)
    model, ids = load_model_and_ids(args.model, builtin_text(), args.seq_len)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=5, save_strategy="steps",
        save_steps=args.save_steps, save_total_limit=2, report_to=[], use_cpu=not torch.cuda.is_available(),
    )
    # The one smp line: Trainer(...) -> SMPTrainer(..., smp_config=...).
    trainer = SMPTrainer(model=model, args=training_args, train_dataset=PackedRows(ids, args.seq_len),
                         smp_config=args.config)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        print(f"saved {os.path.join(args.output_dir, 'final')} (AutoModelForCausalLM.from_pretrained loads it)")


if __name__ == "__main__":
    main()
