"""Distributed checkpoints: sharded save/load that reshards, atomic commits, exact resume,
and Hugging Face safetensors export/import.

    smp.checkpointing.save("ckpt/step_100", model, optimizer, extra={"step": 100})
    extra = smp.checkpointing.load(smp.checkpointing.latest("ckpt"), model, optimizer)
    smp.checkpointing.export_hf("out/hf", model)
    smp.checkpointing.load_hf("some/local/hf_dir", model)
"""

from smp.checkpointing.atomic import latest
from smp.checkpointing.hf import export_hf, load_hf
from smp.checkpointing.metadata import CheckpointError
from smp.checkpointing.sharded import load, save, wait

__all__ = ["CheckpointError", "export_hf", "latest", "load", "load_hf", "save", "wait"]
