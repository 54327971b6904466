"""smp under other training frameworks: transformers' Trainer, TRL's trainers, PEFT LoRA, and
plain accelerate loops.

    from smp.integrations import SMPTrainer, smp_trainer_class

Needs the `trainer` extra (transformers, accelerate; trl and peft for those). See docs/trainer.md
and docs/accelerate.md. A plain accelerate script needs nothing from here: `smp.init()` adapts
the script's `Accelerator` (smp/integrations/accelerate.py).

Names are imported on first use, so that `smp.integrations.saving` or `.accelerate` can be
imported without transformers' Trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "SMPTrainer": "trainer", "SMPTrainerMixin": "trainer", "smp_trainer_class": "trainer",
    "export_hf_folder": "saving", "save_adapter": "peft",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"smp.integrations.{_WHERE[name]}"), name)
    try:  # a submodule: smp.integrations.trainer after `import smp.integrations`
        return importlib.import_module(f"smp.integrations.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"smp.integrations.{name}":
            raise  # the submodule exists; a package it needs is missing
        raise AttributeError(f"module 'smp.integrations' has no attribute {name!r}") from None
