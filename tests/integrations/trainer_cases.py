"""Trainer runs for tests/integrations/test_trainer.py: the rank-side cases (run on every rank of a RankPool)
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
from smp.testing.distributed import full_tensor
from tests import REPO_ROOT

ROWS, SEQ, GLOBAL_BATCH = 64, 16, 8
# Eval rows that do not fill the last dp-wide batch: accelerate pads it and drops the padding.
EVAL_ROWS, EVAL_BATCH = 10, 4


class TokenRows(Dataset):
    """Fixed random token rows, labels = inputs (the causal LM shifts them itself)."""

    def __init__(self, rows: int = ROWS, seq: int = SEQ, vocab: int = 256, seed: int = 7):
        self.rows = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build_model(lora: bool | str = False):
    """The tiny Llama; `lora` True: with PEFT's default LoRA (B = 0), "random": adapters beside
    column-wise (q, v, up) and row-wise (o, down) layers, B random too, so that a wrong adapter
    output moves the loss from the first step."""
    from smp.models import build_causal_lm, resolve_model_config

    torch.manual_seed(0)
    model = build_causal_lm(resolve_model_config("tiny", max_position_embeddings=64))
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "up_proj"] + (["o_proj", "down_proj"] if lora == "random" else [])
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                 init_lora_weights=lora != "random"))
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


def reference(output_dir: str, grad_accum: int = 1, steps: int = 4, lora: bool | str = False) -> dict:
    """The single-process Trainer on the global batch (run in the test process, no smp)."""
    from transformers import Trainer

    model = build_model(lora)
    trainer = Trainer(model=model, args=training_args(output_dir, 1, grad_accum, steps), train_dataset=TokenRows())
    trainer.train()
    out = {"losses": losses_of(trainer), "logits": _logits(model)}
    if lora:  # the trained adapters, and the folder the plain Trainer's save_model writes (PEFT's save_pretrained)
        out["adapters"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        out["adapter_dir"] = os.path.join(output_dir, "final")
        trainer.save_model(out["adapter_dir"])
    return out


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


def train(config: dict, output_dir: str, grad_accum: int = 1, steps: int = 4, lora: bool | str = False,
          save_steps: int | None = None, resume: str | None = None, export: bool = False,
          world_rank_data: bool = False, eval_probe: bool = False, corrupt: str | None = None) -> dict:
    """SMPTrainer on this rank. Returns the per-step losses (and, on request, what else the test checks).

    `world_rank_data` puts back accelerate's own loader sharding (by world rank), which under
    tensor parallelism feeds the ranks of one TP group different rows: the negative control.
    `eval_probe` counts input tokens and predicts EVAL_ROWS rows after training (see _eval_probe).
    `corrupt` "unreduced" (LoRA under TP, negative control): a row-wise layer's adapter output is
    left as this rank's partial sum (tests/tensor_parallel/lora_tp_cases.py).
    """
    import contextlib

    from smp.integrations import SMPTrainer
    from tests.tensor_parallel.lora_tp_cases import _corrupted

    overrides = {}
    if save_steps:
        overrides.update(save_strategy="steps", save_steps=save_steps, save_total_limit=2)
    if eval_probe:
        overrides.update(include_num_input_tokens_seen="all", per_device_eval_batch_size=EVAL_BATCH)
    with smp.session(config):
        dp = smp.state.dp_size
        model = build_model(lora)
        with _corrupted(corrupt) if corrupt else contextlib.nullcontext():  # smp transforms inside the constructor
            trainer = SMPTrainer(model=model, args=training_args(output_dir, dp, grad_accum, steps, **overrides),
                                 train_dataset=TokenRows(), smp_config=config)
        if world_rank_data:
            del trainer.accelerator.prepare_data_loader  # the class's method again
        trainer.train(resume_from_checkpoint=resume)
        result = {"losses": losses_of(trainer), "dp": dp,
                  "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
                  "optimized": sum(len(g["params"]) for g in trainer.optimizer.param_groups)}
        if eval_probe:
            result.update(_eval_probe(trainer))
        if export:
            final = os.path.join(output_dir, "final")
            trainer.save_model(final)
            logits = _logits(trainer.model)
            result["logits_diff"] = _reload_diff(final, logits, lora) if dist.get_rank() == 0 else 0.0
            dist.barrier()
        params = {n: full_tensor(p).detach().clone() for n, p in trainer.model.named_parameters()}  # collective
        result["params"] = params if dist.get_rank() == 0 else None
        return result


def _eval_probe(trainer) -> dict:
    """What the Trainer counted and gathered: tokens seen, and predict()'s label rows (each eval
    row once, in dataset order, whatever the mesh). The control: accelerate's own gather (over
    every process) of one row per rank returns one row per process, i.e. each dp rank's row
    once per TP rank."""
    from accelerate import Accelerator

    out = trainer.predict(TokenRows(rows=EVAL_ROWS, seed=5))
    mine = torch.tensor([smp.state.dp_rank])
    return {
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "eval_labels": torch.as_tensor(out.label_ids), "eval_predictions_rows": len(out.predictions),
        "gathered_dp_ranks": trainer.accelerator.gather_for_metrics(mine).tolist(),
        "gathered_dp_ranks_by_world": Accelerator.gather_for_metrics(trainer.accelerator, mine).tolist(),
    }


def _reload_diff(folder: str, logits: torch.Tensor, lora: bool | str) -> float:
    """from_pretrained on the saved folder (no smp) vs the trained model's logits."""
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(build_model(lora=False), folder)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(folder)
    return float((_logits(reloaded) - logits).abs().max())


# ----------------------------------------------------------------------------------------------
# TRL SFTTrainer on examples/data/chat.jsonl, with the example's tokenizer and model.

SFT_STEPS = 3


def _sft_example():
    """examples/finetune_sft.py as a module (its tokenizer and chat template)."""
    import importlib.util

    path = os.path.join(str(REPO_ROOT), "examples", "finetune_sft.py")
    spec = importlib.util.spec_from_file_location("finetune_sft", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sft_parts(output_dir: str, dp: int, save_at_end: bool = False):
    """(model, tokenizer, dataset, SFTConfig) as the example builds them. TRL's defaults stay:
    gradient_checkpointing=True (smp maps it onto its own); bf16 is off because fp32 is what
    makes the runs comparable to 1e-5."""
    import json

    from datasets import Dataset
    from trl import SFTConfig

    from smp.models import build_causal_lm, resolve_model_config

    example = _sft_example()
    tokenizer = example.byte_tokenizer()
    torch.manual_seed(0)
    model = build_causal_lm(resolve_model_config("tiny", vocab_size=len(tokenizer), max_position_embeddings=256))
    with open(os.path.join(os.path.dirname(example.__file__), "data", "chat.jsonl")) as f:
        dataset = Dataset.from_list([json.loads(line) for line in f if line.strip()])
    config = SFTConfig(
        output_dir=output_dir, max_steps=SFT_STEPS, per_device_train_batch_size=GLOBAL_BATCH // dp,
        learning_rate=1e-2, max_length=256, logging_steps=1, report_to=[], seed=0,
        save_strategy="steps" if save_at_end else "no", save_steps=SFT_STEPS,
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=True, bf16=False,
    )
    return model, tokenizer, dataset, config


def sft_reference(output_dir: str) -> dict:
    """The single-process SFTTrainer on the global batch (run in the test process, no smp)."""
    from trl import SFTTrainer

    model, tokenizer, dataset, config = _sft_parts(output_dir, 1)
    assert config.gradient_checkpointing  # TRL's default, checkpointed by transformers here
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return {"losses": losses_of(trainer)}


def sft_train(config: dict, output_dir: str) -> dict:
    """smp_trainer_class(SFTTrainer) on this rank; TRL's gradient_checkpointing=True becomes smp's."""
    from trl import SFTTrainer

    from smp.activations.checkpointing import is_checkpointed
    from smp.integrations import smp_trainer_class

    with smp.session(config):
        model, tokenizer, dataset, args = _sft_parts(output_dir, smp.state.dp_size, save_at_end=True)
        trainer = smp_trainer_class(SFTTrainer)(model=model, args=args, train_dataset=dataset,
                                                processing_class=tokenizer, smp_config=config)
        trainer.train()
        return {
            "losses": losses_of(trainer),
            "checkpointed_blocks": sum(is_checkpointed(m) for m in trainer.model.modules()),
            "trainer_gradient_checkpointing": trainer.args.gradient_checkpointing,
            "caller_gradient_checkpointing": args.gradient_checkpointing,
            # TRL's own _save_checkpoint step, taken by smp's: a draft model card in output_dir.
            "model_card": os.path.isfile(os.path.join(output_dir, "README.md")),
            "checkpoint_committed": smp.checkpointing.latest(output_dir) is not None,
        }


def train_smp_opens_session(config: dict, output_dir: str, grad_accum: int = 1, seed: int = 0) -> dict:
    """SMPTrainer that calls smp.init itself (no session before it), as a script that only swaps
    Trainer for SMPTrainer does: the Trainer's `seed` must decide the data order."""
    from smp.integrations import SMPTrainer

    try:
        dp = dist.get_world_size() // config.get("tensor_parallel_degree", 1)
        trainer = SMPTrainer(model=build_model(), args=training_args(output_dir, dp, grad_accum, seed=seed),
                             train_dataset=TokenRows(), smp_config=config)
        trainer.train()
        return {"losses": losses_of(trainer)}
    finally:
        smp.shutdown()
