"""Evaluation of a pipelined model: the forward of every micro-batch through torch's schedule,
no backward (`_PipelineScheduleBase.eval`), the batch's loss on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp.context_parallel.attention import active as active_context_parallel
from smp.errors import UsageError
from smp.pipeline.schedule import IGNORE_INDEX, PipelinedModel, checked_batch


@torch.no_grad()
def evaluate(model: PipelinedModel, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of the whole batch from the forward pass alone, on every rank: next-token
    cross-entropy averaged over every target of the global batch (labels of -100 ignored, the
    count summed over the data-parallel ranks), what `model(input_ids, labels=labels).loss`
    gives on the whole model and batch. Gradients are untouched. Put the model in eval mode
    first (`model.eval()`) when its forward has dropout.

    The arguments are `smp.pipeline.step`'s: this rank's data-parallel rows, the same on every
    pipeline rank, split into the config's micro-batches; a right-padded `attention_mask`.
    """
    labels, microbatches = checked_batch(
        model, "smp.pipeline.evaluate", input_ids, labels, attention_mask,
        elsewhere="; evaluate any other model with model(input_ids, labels=labels).loss",
    )
    setup = active_context_parallel()
    if setup is not None and setup.size > 1:
        # step cuts each row for its cp rank and hands the stages their global positions;
        # evaluate feeds whole rows, which the stages' cp attention would read as chunks.
        raise UsageError(
            f"smp.pipeline.evaluate with context_parallel_degree={setup.size} is not built (it does not cut the "
            f"rows for the cp ranks as smp.pipeline.step does); evaluate in a session with context_parallel_degree: 1"
        )
    if model._schedule is None or model._loss_fn is not None:  # the default (token-mean) loss
        model._loss_fn = None
        model._schedule = model._build_schedule(microbatches)
    # As smp.pipeline.step weighs it: each rank's share of the global batch's target count, times
    # dp, so that the mean over the data-parallel ranks below is the global batch's loss.
    dp = 1 if model.dp_group is None else dist.get_world_size(model.dp_group)
    targets = (labels[:, 1:] != IGNORE_INDEX).sum().to(model.device, torch.float64)
    if model.dp_group is not None:
        dist.all_reduce(targets, group=model.dp_group)
    model._scale = dp / max(float(targets), 1.0)
    input_ids, labels = input_ids.to(model.device), labels.to(model.device)
    losses: list[torch.Tensor] = []
    model._schedule.eval(input_ids, target=labels, losses=losses)
    total = torch.stack([loss.float() for loss in losses]).sum() if losses else torch.zeros((), device=model.device)
    dist.all_reduce(total, group=model.pp_group)  # only the last stage's rank has the losses
    if model.dp_group is not None:
        dist.all_reduce(total, group=model.dp_group)
        total /= dp
    return total
