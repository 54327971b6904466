"""Seeding: the same `random_seed` gives the same model init and data order on every rank."""

from __future__ import annotations

import random
from typing import Any

import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def trainer_seed_wins(config: Any, trainer_seed: int, full_determinism: bool, rank: int) -> None:
    """After `smp.init` inside a transformers Trainer: the Trainer's `seed` decides the data order
    and every draw after it, as in a plain Trainer run (smp.init reseeded the process with
    `random_seed`, which accelerate's seedable sampler would then use). A config that sets
    `random_seed` explicitly keeps it, and rank 0 says once that the Trainer's seed was overridden."""
    if "random_seed" in config.model_fields_set:
        if config.random_seed != trainer_seed and rank == 0 and not _told:
            _told.append(True)
            print(
                f"smp: random_seed={config.random_seed} from the smp config seeds this run, not the "
                f"Trainer's seed={trainer_seed}: the data order differs from a plain Trainer run with "
                f"seed={trainer_seed} (remove random_seed from the smp config to use the Trainer's)",
                flush=True,
            )
        return
    from transformers.trainer_utils import enable_full_determinism, set_seed

    enable_full_determinism(trainer_seed) if full_determinism else set_seed(trainer_seed)


_told: list[bool] = []  # the override is printed once per process
