"""The final model as a Hugging Face folder for the integrations (Trainer, accelerate):
`export_hf_folder` writes it into a folder that holds other files (smp.checkpointing.hf.folder),
as `save_pretrained` writes into a run's output_dir beside its `step_N` folders.

`full_state_dict` is the whole model as plain host tensors, for `accelerator.get_state_dict`.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from smp import _compat, runtime
from smp.checkpointing.format import packed
from smp.checkpointing.hf import folder as hf_folder
from smp.checkpointing.hf import DEFAULT_MAX_SHARD_BYTES
from smp.errors import ConfigError
from smp.pipeline.schedule import PipelinedModel


def export_hf_folder(out_dir: str | os.PathLike | nn.Module, model: nn.Module | str | os.PathLike, *,
                     dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Export `model` to `out_dir` (created if missing; other files there are kept), in the
    argument order of smp.checkpointing.export_hf. Collective: every rank calls it."""
    if isinstance(out_dir, nn.Module):  # the order before this release: (model, out_dir)
        warnings.warn("export_hf_folder(model, out_dir) is deprecated: pass export_hf_folder(out_dir, model), "
                      "the order of smp.checkpointing.export_hf", DeprecationWarning, stacklevel=2)
        out_dir, model = model, out_dir
    dims = runtime.state.dims if runtime.is_initialized() else None
    return hf_folder.export_into(out_dir, model, dims=dims, dtype=dtype, max_shard_bytes=max_shard_bytes)


holds_other_files = hf_folder.holds_other_files


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain host tensors, on every rank (sharded and
    tensor-parallel parameters gathered, packed q|k|v / gate|up ones in their real layout).
    Collective: every rank calls it. A pipelined model holds one stage per rank: refused."""
    if isinstance(model, PipelinedModel):
        raise ConfigError(
            "the whole state dict of a pipelined model is not gathered on one rank; write it with "
            "model.save_pretrained(folder) or smp.checkpointing.export_hf(folder, model) (every rank)")
    state = get_model_state_dict(model)
    state = packed.whole_for_save(state, packed.packed_keys(state))
    return {k: (_compat.full_tensor(v.detach()) if isinstance(v, DTensor) else v.detach()).cpu()
            for k, v in state.items()}
