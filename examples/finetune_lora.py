"""PEFT LoRA under smp with transformers' Trainer: the base model frozen and sharded, the
adapters trained (the optimizer holds only them), the adapter saved as save_pretrained does.

    torchrun --standalone --nproc-per-node 2 examples/finetune_lora.py
    torchrun --standalone --nproc-per-node 2 examples/finetune_lora.py --config examples/configs/cpu_checkpointing.yaml
    torchrun --standalone --nproc-per-node 4 examples/finetune_lora.py --model /path/to/hf_model --config my.yaml

Full or hybrid sharding, tensor parallelism (tensor_parallel_degree in --config: the base layers
split by their plan, each adapter pair placed beside its layer) and activation checkpointing
apply to LoRA models. Output: --output-dir/adapter, which PeftModel.from_pretrained(base_model,
folder) loads.
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments

from finetune_trainer import PackedRows, builtin_text, load_model_and_ids
from smp.integrations import SMPTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="smp config (YAML/JSON); default: $SMP_CONFIG or smp's defaults")
    p.add_argument("--model", default=None, help="a local save_pretrained folder; default: a tiny Llama")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--output-dir", default="runs/lora")
    args = p.parse_args()

    torch.manual_seed(0)
    model, ids = load_model_and_ids(args.model, builtin_text(), args.seq_len)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.per_device_batch,
        learning_rate=args.lr, logging_steps=5, save_strategy="steps", save_steps=max(1, args.steps // 2),
        save_total_limit=1, report_to=[], use_cpu=not torch.cuda.is_available(),
    )
    trainer = SMPTrainer(model=model, args=training_args, train_dataset=PackedRows(ids, args.seq_len),
                         smp_config=args.config)
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "adapter"))
    if trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(f"trained {trainable:,} adapter parameters; saved {os.path.join(args.output_dir, 'adapter')}")


if __name__ == "__main__":
    main()
