"""TrainingArguments that smp carries out itself: `bf16` and `gradient_checkpointing`.

TRL's configs turn both on by default. Each has an smp counterpart that does the same job
inside FSDP2, so instead of refusing them we hand the job to smp and turn the Trainer's own
version off (two owners would cast or recompute twice):

  bf16=True                   -> mixed_precision.param_dtype: bf16 (FSDP2 casts each unit's
                                 parameters; reduce_dtype stays the config's, fp32 by default)
  gradient_checkpointing=True -> activation_checkpointing: full (every_n_layers from
                                 activation_checkpointing_kwargs), recomputed inside each FSDP unit

Only when the smp config leaves that setting open; when it sets the same thing there is nothing
to do, and when it sets something else the two disagree and we refuse, naming both.
fp16 is refused: fp16 training needs the Trainer's loss scaler, which smp's FSDP policy does not drive.
"""

from __future__ import annotations

import copy
from typing import Any

from smp.config import ActivationCheckpointingConfig, SMPConfig, canonical_dtype
from smp.errors import ConfigError


def map_training_arguments(args: Any, cfg: SMPConfig) -> tuple[Any, SMPConfig, list[str]]:
    """(args, cfg, what was mapped): a copy of `args` with bf16 / gradient checkpointing off when
    smp takes them over, the config with them on, and one phrase per mapping for the log.
    Raises ConfigError when the two set the same thing differently. `args` itself is not changed."""
    if args is None:
        return args, cfg, []
    arg_updates: dict[str, Any] = {}
    cfg_updates: dict[str, Any] = {}
    mapped: list[str] = []
    policy = canonical_dtype(cfg.mixed_precision.param_dtype)

    if getattr(args, "fp16", False):
        smp_side = (f"the smp config's mixed_precision.param_dtype={cfg.mixed_precision.param_dtype!r}" if policy
                    else "smp (which takes mixed precision from its config only)")
        raise ConfigError(
            f"TrainingArguments `fp16=True` and {smp_side} both set mixed precision: drop `fp16` and set "
            f"mixed_precision.param_dtype ('bf16' or 'fp16') in the smp config; FSDP2 then casts per unit"
        )
    # `accelerate launch --mixed_precision bf16` sets it without bf16=True.
    if getattr(args, "bf16", False) or getattr(args, "mixed_precision", "no") == "bf16":
        if policy is None:
            cfg_updates["mixed_precision"] = cfg.mixed_precision.model_copy(update={"param_dtype": "bfloat16"})
            mapped.append(f"bf16=True -> mixed_precision {{param_dtype: bf16, reduce_dtype: "
                          f"{canonical_dtype(cfg.mixed_precision.reduce_dtype)}}}")
        elif policy != "bfloat16":
            raise ConfigError(
                f"TrainingArguments `bf16=True` and the smp config's mixed_precision.param_dtype="
                f"{cfg.mixed_precision.param_dtype!r} set different mixed precision: drop `bf16` (bf16=False) or "
                f"set mixed_precision.param_dtype: bf16 in the smp config"
            )
        arg_updates.update(bf16=False, mixed_precision="no")

    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        every_n = int((getattr(args, "activation_checkpointing_kwargs", None) or {}).get("every_n_layers", 1))
        wanted = ActivationCheckpointingConfig(mode="full", every_n_layers=every_n)
        ac = cfg.activation_checkpointing
        if "activation_checkpointing" not in cfg.model_fields_set:
            cfg_updates["activation_checkpointing"] = wanted
            mapped.append("gradient_checkpointing=True -> activation_checkpointing: full"
                          + (f" (every_n_layers: {every_n})" if every_n > 1 else ""))
        elif (ac.mode, ac.every_n_layers) != (wanted.mode, wanted.every_n_layers):
            raise ConfigError(
                f"TrainingArguments `activation_checkpointing` / `gradient_checkpointing` (full, every "
                f"{every_n} layer(s)) and the smp config's activation_checkpointing (mode {ac.mode!r}, every "
                f"{ac.every_n_layers}) are both set, differently: drop one (gradient_checkpointing=False keeps "
                f"the smp config's; smp recomputes each block inside its FSDP unit)"
            )
        arg_updates.update(activation_checkpointing=False, gradient_checkpointing=False)

    if arg_updates:
        # A shallow copy, not dataclasses.replace: __post_init__ would run again (process group,
        # environment). The caller's object stays as given.
        args = copy.copy(args)
        for name, value in arg_updates.items():
            setattr(args, name, value)
    if cfg_updates:
        cfg = cfg.model_copy(update=cfg_updates)
    return args, cfg, mapped
