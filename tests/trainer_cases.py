"""Trainer runs for tests/test_trainer.py: the rank-side cases (run on every rank of a RankPool)
and the single-process reference they are compared with (run in the test process).

Every run trains the same tiny Llama (same seed) on the same fixed rows with the same seeded
sampler; the reference takes the whole global batch in one process, so per-step losses must
agree whatever the mesh.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import smp

ROWS, SEQ, GLOBAL_BATCH = 64, 16, 8


class TokenRows(Dataset):
    """Fixed random token rows, labels = inputs (the causal LM shifts them itself)."""

    def __init__(self, rows: int = ROWS, seq: int = SEQ, vocab: int = 256, seed: int = 7):
        self.rows = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build_model(lora: bool = False):
    from smp.models import build_causal_lm, resolve_model_config

    torch.manual_seed(0)
    model = build_causal_lm(resolve_model_config("tiny", max_position_embeddings=64))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "up_proj"]))
    return model


def training_args(output_dir: str, dp: int, grad_accum: int = 1, steps: int = 4, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // (dp * grad_accum),
        gradient_accumulation_steps=grad_accum, max_steps=steps, learning_rate=1e-2, warmup_steps=1,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def losses_of(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def reference(output_dir: str, grad_accum: int = 1, steps: int = 4, lora: bool = False) -> dict:
    """The single-process Trainer on the global batch (run in the test process, no smp)."""
    from transformers import Trainer

    model = build_model(lora)
    trainer = Trainer(model=model, args=training_args(output_dir, 1, grad_accum, steps), train_dataset=TokenRows())
    trainer.train()
    return {"losses": losses_of(trainer), "logits": _logits(model)}


def _probe() -> torch.Tensor:
    return TokenRows(rows=2, seed=99).rows


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    from torch.distributed.fsdp import FSDPModule

    model.eval()
    out = model(input_ids=_probe()).logits
    model.train()
    for m in model.modules():  # the root stays gathered after forward (reshard_after_forward=False)
        if isinstance(m, FSDPModule):
            m.reshard()
    return out


def train(config: dict, output_dir: str, grad_accum: int = 1, steps: int = 4, lora: bool = False,
          save_steps: int | None = None, resume: str | None = None, export: bool = False,
          world_rank_data: bool = False) -> dict:
    """SMPTrainer on this rank. Returns the per-step losses (and, on request, what else the test checks).

    `world_rank_data` puts back accelerate's own loader sharding (by world rank), which under
    tensor parallelism feeds the ranks of one TP group different rows: the negative control.
    """
    from smp.integrations import SMPTrainer

    overrides = {}
    if save_steps:
        overrides.update(save_strategy="steps", save_steps=save_steps, save_total_limit=2)
    with smp.session(config):
        dp = smp.state.dp_size
        model = build_model(lora)
        trainer = SMPTrainer(model=model, args=training_args(output_dir, dp, grad_accum, steps, **overrides),
                             train_dataset=TokenRows(), smp_config=config)
        if world_rank_data:
            del trainer.accelerator.prepare_data_loader  # the class's method again
        trainer.train(resume_from_checkpoint=resume)
        result = {"losses": losses_of(trainer), "dp": dp,
                  "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
                  "optimized": sum(len(g["params"]) for g in trainer.optimizer.param_groups)}
        if export:
            final = os.path.join(output_dir, "final")
            trainer.save_model(final)
            logits = _logits(trainer.model)
            result["logits_diff"] = _reload_diff(final, logits, lora) if dist.get_rank() == 0 else 0.0
            dist.barrier()
        params = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}  # collective
        result["params"] = params if dist.get_rank() == 0 else None
        return result


def _reload_diff(folder: str, logits: torch.Tensor, lora: bool) -> float:
    """from_pretrained on the saved folder (no smp) vs the trained model's logits."""
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(build_model(lora=False), folder)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(folder)
    return float((_logits(reloaded) - logits).abs().max())
