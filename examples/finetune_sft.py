"""TRL's SFTTrainer with smp doing the parallelism, on chat data (examples/data/chat.jsonl).

    torchrun --standalone --nproc-per-node 2 examples/finetune_sft.py
    torchrun --standalone --nproc-per-node 4 examples/finetune_sft.py --config examples/configs/hybrid.yaml
    torchrun --standalone --nproc-per-node 8 examples/finetune_sft.py --model /path/to/hf_chat_model --data chats.jsonl

The smp change to a TRL script: `smp_trainer_class(SFTTrainer)(..., smp_config=...)`. TRL's
defaults bf16=True and gradient_checkpointing=True stay: smp maps them onto its own bf16
mixed-precision policy and activation checkpointing (docs/trainer.md), unless the smp config
sets those otherwise.
By default a tiny Llama over a byte-level tokenizer made here (no download); --model takes a
local folder with a tokenizer that has a chat template.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from smp.integrations import smp_trainer_class
from smp.models import build_causal_lm, resolve_model_config

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes as tokens (a byte-level BPE without merges) plus three special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="smp config (YAML/JSON); default: $SMP_CONFIG or smp's defaults")
    p.add_argument("--model", default=None, help="a local save_pretrained folder with a chat tokenizer")
    p.add_argument("--data", default=str(Path(__file__).parent / "data" / "chat.jsonl"),
                   help='.jsonl with a "messages" list per line')
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output-dir", default="runs/sft")
    args = p.parse_args()

    torch.manual_seed(0)
    if args.model is None:
        tokenizer = byte_tokenizer()
        model = build_causal_lm(resolve_model_config("tiny", vocab_size=len(tokenizer), max_position_embeddings=256))
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    dataset = load_dataset("json", data_files=args.data, split="train")

    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.per_device_batch,
        learning_rate=args.lr, max_length=256, logging_steps=5, save_strategy="steps",
        save_steps=max(1, args.steps // 2), save_total_limit=1, report_to=[], use_cpu=not torch.cuda.is_available(),
    )
    trainer = smp_trainer_class(SFTTrainer)(model=model, args=config, train_dataset=dataset,
                                            processing_class=tokenizer, smp_config=args.config)
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        print(f"saved {os.path.join(args.output_dir, 'final')} (model + tokenizer, from_pretrained loads it)")


if __name__ == "__main__":
    main()
