"""transformers' Trainer, accelerate, TRL/PEFT, and SMP v2 (smp.sagemaker) scripts."""
