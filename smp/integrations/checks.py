"""Settings that cannot run together with smp under the transformers Trainer, refused at start.

Every check reads only the arguments and the config (no collective has run yet), so a bad
combination fails on every rank alike with one message naming both settings.
"""

from __future__ import annotations

import os
from typing import Any

from smp.composition import check_run
from smp.config import SMPConfig
from smp.errors import ConfigError


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def check_no_pipeline(cfg: SMPConfig) -> None:
    """Refuse what smp/composition.py refuses under the Trainer: pipeline parallelism (its training
    step runs the whole model's forward on every rank, and its evaluation calls the model; a
    pipelined model holds one stage per rank and trains only through smp.step)."""
    check_run(cfg, ("trainer",))  # the table's row for the Trainer with pipeline parallel


def check_training_arguments(args: Any, cfg: SMPConfig, *, is_peft: bool, has_model_init: bool) -> None:
    """Raise ConfigError for TrainingArguments (or launcher settings) that smp replaces.

    smp owns sharding, tensor parallelism, mixed precision and activation checkpointing; a second
    owner of any of them would wrap the model twice or silently be ignored. (`bf16`, `fp16` and
    `gradient_checkpointing` are mapped onto the smp config, or refused, by mapping.py first.)
    """
    if args is None:
        return
    if args.fsdp or args.fsdp_config:
        raise ConfigError(
            "TrainingArguments `fsdp` / `fsdp_config` (accelerate's FSDP) and smp_config are both set: "
            "smp already shards the model with FSDP2; drop `fsdp`/`fsdp_config` and set the sharding "
            "in the smp config (hybrid_shard_degree, reshard_after_forward, ...)"
        )
    if _env_flag("ACCELERATE_USE_FSDP"):
        raise ConfigError(
            "accelerate's FSDP plugin is enabled (ACCELERATE_USE_FSDP, from `accelerate launch` with an FSDP "
            "config) and smp_config is set: launch with torchrun or an accelerate config without FSDP"
        )
    if args.deepspeed or _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError(
            "TrainingArguments `deepspeed` (or ACCELERATE_USE_DEEPSPEED) and smp_config are both set: "
            "use one parallelism backend; drop the DeepSpeed config to train with smp"
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise ConfigError(
            "TrainingArguments `parallelism_config` (accelerate's TP/CP mesh) and smp_config are both set: "
            "set tensor_parallel_degree / hybrid_shard_degree in the smp config instead"
        )
    if args.load_best_model_at_end:
        raise ConfigError(
            "TrainingArguments `load_best_model_at_end` is not supported with smp_config: smp checkpoints are "
            "sharded; load the best one with smp.checkpointing.load after training"
        )
    if has_model_init:
        raise ConfigError("Trainer `model_init` is not supported with smp_config: pass the model itself")
    check_run(cfg, ("trainer", "peft") if is_peft else ("trainer",))  # what composes: smp/composition.py
