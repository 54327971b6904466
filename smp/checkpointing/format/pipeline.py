"""Checkpoints of a pipelined model: this rank's stages under the whole model's names.

A rank of a pipeline holds a slice of the model (its stages). Saved through `stages_view`, its
state dict and optimizer state carry the names a model without pp has, so the pipeline's ranks
together write one checkpoint of the whole model that any layout loads (pp 1, another pp
degree, TP x FSDP), and a pipelined model loads any checkpoint of that model: DCP reads each
rank's names. The checks that look at the whole model (the parameter list recorded and
compared, the export's file layout) gather the slices over the pipeline group first, and a
name two stages both claim (a split that renumbered its layers) is refused before anything
is written.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from smp.errors import CheckpointError


def stages_view(model: nn.Module) -> tuple[nn.Module, list[nn.Module], dist.ProcessGroup | None]:
    """(a module naming this rank's tensors as the whole model does, the stage modules, the
    pipeline group) for a pipelined model; (model, [model], None) for any other."""
    from smp.pipeline.schedule import PipelinedModel
    from smp.pipeline.split import whole_model_view

    if isinstance(model, PipelinedModel):
        stages = list(model.stages)
        return whole_model_view(stages), stages, model.pp_group
    return model, [model], None


def gather_over_pipeline(local: Any, pp_group: dist.ProcessGroup) -> list[Any]:
    """`local` of every rank of this rank's pipeline, in pipeline-rank order. Collective."""
    out: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(out, local, group=pp_group)
    return out


def whole_model_shapes(
    shapes: dict[str, list[int]], pp_group: dist.ProcessGroup | None, what: str
) -> dict[str, list[int]]:
    """The whole model's name -> shape from each pipeline rank's `shapes`; CheckpointError (on
    every rank alike) when two pipeline ranks hold a tensor under the same name, which would
    make one overwrite the other in the checkpoint. Collective over the pipeline group."""
    if pp_group is None:
        return shapes
    merged: dict[str, list[int]] = {}
    holder: dict[str, int] = {}
    clashes = []
    for pp_rank, part in enumerate(gather_over_pipeline(shapes, pp_group)):
        for name, shape in part.items():
            if name in holder:
                clashes.append(f"{name} (pipeline ranks {holder[name]} and {pp_rank})")
            holder.setdefault(name, pp_rank)
            merged.setdefault(name, shape)
    if clashes:
        raise CheckpointError(
            f"{what}: {len(clashes)} tensor name(s) are held by two pipeline stages, e.g. "
            f"{', '.join(clashes[:3])}: each stage must keep the whole model's names (a stage whose layers "
            "are numbered from 0 would overwrite another's). Split the model with smp.transform"
        )
    return merged
