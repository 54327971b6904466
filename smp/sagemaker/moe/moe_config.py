"""`torch.sagemaker.moe.moe_config.MoEConfig`: SMP v2's MoE options, read as smp's `moe:` config
section (smp.expert_parallel applies it when expert_parallel_degree > 1)."""

from __future__ import annotations

from typing import Any

import smp
from smp.config import load_config
from smp.sagemaker._guide import section


class MoEConfig:
    """SMP v2's keys: `smp_moe`, `random_seed`, `use_cpu_initialization`, and the `moe:` keys
    (moe_load_balancing, moe_aux_loss_coeff, moe_z_loss_coeff, global_token_shuffle,
    moe_all_to_all_dispatcher, ...), validated now: an option smp does not implement is a
    ConfigError naming it."""

    def __init__(self, smp_moe: bool = True, random_seed: int = 12345, use_cpu_initialization: bool = False,
                 **moe_keys: Any) -> None:
        self.smp_moe = smp_moe
        self.random_seed = random_seed
        self.use_cpu_initialization = use_cpu_initialization  # smp materialises per shard: nothing to choose
        self.moe = load_config({"moe": moe_keys}).moe

    def check_matches(self, config: Any) -> None:
        """smp reads MoE options from the config given to init: refuse a MoEConfig that says otherwise."""
        differs = []
        if self.random_seed != config.random_seed:
            differs.append(f"random_seed {self.random_seed} vs {config.random_seed}")
        if self.moe != config.moe:
            differs.append(f"moe {self.moe.model_dump(exclude_defaults=True)} vs {config.moe.model_dump(exclude_defaults=True)}")
        if differs:
            raise smp.ConfigError(
                "transform(model, config=MoEConfig(...)) differs from the config given to init ("
                + "; ".join(differs) + "): smp takes MoE options from that config; put them under "
                f"`moe:` (and random_seed) there and drop the config argument (see {section('moe')})"
            )
