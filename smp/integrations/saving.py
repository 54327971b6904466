"""The final model as a Hugging Face folder that `from_pretrained` loads, written by
smp.checkpointing.export_hf (sharded gather on every rank, consolidation on rank 0).

`Trainer.save_model()` writes into `args.output_dir`, which also holds the run's checkpoints.
export_hf replaces its target folder atomically and so refuses a folder holding other files;
we export into a staging folder inside the target and move the model files up, as
save_pretrained would have written them beside whatever else is there.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch.distributed as dist
from torch import nn

import smp

_STAGING = ".smp_hf_export"
# What export_hf writes besides the weights: kept only inside the staging folder, so that the
# run folder never looks like an smp export (which a later export would replace whole).
_SMP_FILES = ("smp_meta.json", "smp_commit.json")


def export_hf_folder(model: nn.Module, out_dir: str | os.PathLike) -> str:
    """Export `model` to `out_dir` (created if missing; other files there are kept). Collective."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    staging = os.path.join(out_dir, _STAGING)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        # Left by an export that died mid-move: export_hf would refuse it (not a complete export).
        # Only rank 0 touches it, and export_hf's first step on rank 0 comes after this.
        shutil.rmtree(staging, ignore_errors=True)
    smp.checkpointing.export_hf(staging, model)
    error = None
    if rank0:
        try:
            # Old weights of a previous save (another shard count) must not mix with the new ones.
            for old in glob.glob(os.path.join(out_dir, "model*.safetensors")) + glob.glob(
                os.path.join(out_dir, "model.safetensors.index.json")
            ):
                os.remove(old)
            for name in os.listdir(staging):
                if name not in _SMP_FILES:
                    os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
            shutil.rmtree(staging)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)  # also the barrier: the folder is complete for all
        error = box[0]
    if error:
        raise smp.CheckpointError(f"moving the export into {out_dir!r} failed on rank 0: {error}")
    return out_dir
