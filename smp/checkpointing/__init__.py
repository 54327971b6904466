"""Distributed checkpoints: sharded save/load that reshards, atomic commits, exact resume,
and Hugging Face safetensors export/import.

    smp.checkpointing.save("ckpt/step_100", model, optimizer, extra={"step": 100})
    extra = smp.checkpointing.load(smp.checkpointing.latest("ckpt"), model, optimizer)
    smp.checkpointing.export_hf("out/hf", model)
    smp.checkpointing.load_hf("some/local/hf_dir", model)

    ckpt = smp.checkpointing.Checkpointer("ckpt", model, optimizer, scheduler=sched, keep_last=3)
    step = ckpt.resume()   # ... ckpt.save(step) ... ckpt.wait()

This is the public entry point: `save` and `export_hf` (api.py) read smp's run (when `smp.init`
ran) and pass it to sharded.py / hf/ as plain values; those work under any torch.distributed
process group and never read smp's global state. Beside them: commit/ (atomic commits, run
ids, async saves), format/ (what a checkpoint holds), trust/ (digests, safe reads, load
checks), hf/ (Hugging Face export and import), storage.py (every filesystem operation),
checkpointer.py (the common loop). Async saves belong to the session (commit/async_save.py):
smp.shutdown commits a pending one before the process group goes.
"""

from smp.checkpointing.api import export_hf, save
from smp.checkpointing.checkpointer import Checkpointer
from smp.checkpointing.commit.atomic import latest
from smp.checkpointing.hf import load_hf
from smp.checkpointing.sharded import load, wait
from smp.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpointer", "export_hf", "latest", "load", "load_hf", "save", "wait"]
