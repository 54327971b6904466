"""Evaluation of a pipelined model, kept for one release: `smp.evaluate(model, batch)` runs it
(the forward of every micro-batch through torch's schedule, no backward)."""

from __future__ import annotations

import torch

from smp.pipeline.schedule import PipelinedModel, _check_pipelined, _legacy_batch


@torch.no_grad()
def evaluate(model: PipelinedModel, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The global batch's loss from the forward pass alone, on every rank (what
    `smp.evaluate(model, {"input_ids": ..., "labels": ..., "attention_mask": ...})` returns).
    Gradients are untouched. Put the model in eval mode first when its forward has dropout."""
    _check_pipelined(model, "smp.pipeline.evaluate",
                     elsewhere="; evaluate any model with smp.evaluate(model, batch)")
    return model.run(_legacy_batch(input_ids, labels, attention_mask), train=False, caller="smp.pipeline.evaluate")
