"""smp under other training frameworks: transformers' Trainer, TRL's trainers, PEFT LoRA.

    from smp.integrations import SMPTrainer, smp_trainer_class

Needs the `trainer` extra (transformers, accelerate; trl and peft for those). See docs/trainer.md.
"""

from smp.integrations.peft import save_adapter
from smp.integrations.saving import export_hf_folder
from smp.integrations.trainer import SMPTrainer, SMPTrainerMixin, smp_trainer_class

__all__ = ["SMPTrainer", "SMPTrainerMixin", "export_hf_folder", "save_adapter", "smp_trainer_class"]
