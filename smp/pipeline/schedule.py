"""The pipelined model a rank holds and the training step that runs torch's schedules over it."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from smp.config import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, PipelineConfig, check_pipeline
from smp.context_parallel.attention import ContextParallelSetup, active as active_context_parallel
from smp.context_parallel.sharding import check_sequence_length, chunk_positions, shift_labels
from smp.errors import ConfigError, UsageError
from smp.pipeline.split import StageInfo, build_stage_module, check_layer_chain, find_parts, plan_split, stage_indices
from smp.pipeline.tied import TiedGroup, copy_tied_values, norm_skip, plan_ties, set_aside, sum_tied_grads, tied_names

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}

IGNORE_INDEX = -100  # label value that contributes no loss (transformers' convention)


class PipelinedModel(nn.Module):
    """The stages of a model this rank holds (one, or several under virtual-stage schedules).

    Its parameters carry the whole model's names (`model.layers.5.mlp.up_proj.weight`): the
    stages hold disjoint slices, so `named_parameters` / `state_dict` are this rank's slice of the
    model's. Build the optimizer from `parameters()`. Train with `smp.pipeline.step(model,
    input_ids, labels)`; calling it like a module is an error (a pipeline stage cannot run the
    whole model).
    """

    def __init__(self, stages: list[nn.Module], infos: list[StageInfo], split: list[StageInfo],
                 pipe: PipelineConfig, pp_group: dist.ProcessGroup, device: torch.device,
                 dp_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.stage_infos = infos  # this rank's stages
        self.split = split  # every stage of the pipeline (layers, parameters, FLOPs)
        self.pipe = pipe
        self.pp_group = pp_group
        self.dp_group = dp_group  # the ranks holding other rows of the batch (None: this rank holds them all)
        self.device = device
        self._schedule: Any = None
        self._loss_fn: Callable | None = None
        self._scale = 1.0  # set per step: 1 / (what the micro-batch losses are normalised by)
        self.tied: list[TiedGroup] = []  # tied tensors whose copies' gradients the step sums (smp.pipeline.tied)
        self._preshifted = False  # set per step: the targets arrive shifted over the whole row (context parallel)

    # --- names of the whole model -------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()  # a tied tensor two of this rank's stages share is one parameter
        for stage in self.stages:
            for name, p in stage.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
                if not remove_duplicate or id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def copy_tied_values(self) -> None:
        """Give each copy of a tied tensor across stages its source's value (after per-stage
        init). Collective over the ranks holding copies."""
        copy_tied_values(self.tied, list(self.stages), self.pp_group)

    def norm_skip(self) -> set[int]:
        """Ids of this rank's parameters a gradient norm over the pipeline ranks leaves out: the
        copies of a tied tensor another rank (or another local name) already counts."""
        return norm_skip(self.tied, list(self.stages), self.pp_group)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for stage in self.stages:
            yield from stage.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        merged: dict[str, Any] = {}
        for stage in self.stages:
            merged.update(stage.state_dict(*args, **kwargs))
        return merged

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise UsageError(
            "loading a state_dict into a pipelined model (pipeline_parallel_degree > 1) is not built; load a "
            "checkpoint with smp.checkpointing.load(path, model) (any layout's), Hugging Face weights with "
            "smp.checkpointing.load_hf(folder, model), or the state_dict into the model before smp.transform"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Code written for the whole model (checkpointing, export, trainers) reaches for its
            # submodules by name: say what this object is instead of a bare missing attribute.
            raise AttributeError(
                f"a pipelined model (pipeline_parallel_degree > 1) has no attribute {name!r}: it holds only this "
                f"rank's stages (model.stages). smp.checkpointing's save, load and export_hf take the pipelined "
                f"model as it is (docs/pipeline-parallel.md)"
            ) from None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(
            "a pipelined model (pipeline_parallel_degree > 1) holds only this rank's stages and cannot be "
            "called like the whole model: run a training step with smp.pipeline.step(model, input_ids, labels)"
        )

    def describe_split(self) -> str:
        return "\n".join(s.describe() for s in self.split)

    # --- the step ------------------------------------------------------------------------------
    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._preshifted:  # context parallel: position t of this rank's chunks predicts labels[t]
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum",
            )
        elif self._loss_fn is None:  # next-token cross-entropy summed, over the batch's target count
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                ignore_index=IGNORE_INDEX, reduction="sum",
            )
        else:
            loss = self._loss_fn(logits, labels)
        return loss * self._scale

    def _build_schedule(self, microbatches: int) -> Any:
        pp = dist.get_world_size(self.pp_group)
        num_stages = pp * len(self.stages)
        torch_stages = [
            PipelineStage(stage, info.index, num_stages, self.device, group=self.pp_group)
            for stage, info in zip(self.stages, self.stage_infos)
        ]
        cls = SCHEDULE_CLASSES[self.pipe.schedule]
        # scale_grads=False: the loss is already divided so that the micro-batches sum to the
        # whole batch's loss (torch's default divides by the micro-batch count, which equals the
        # batch mean only when every micro-batch holds as many targets).
        if self.pipe.schedule in SINGLE_STAGE_SCHEDULES:
            return cls(torch_stages[0], n_microbatches=microbatches, loss_fn=self._stage_loss, scale_grads=False)
        return cls(torch_stages, n_microbatches=microbatches, loss_fn=self._stage_loss, scale_grads=False)

    def _holds_last(self) -> bool:
        return any(info.last for info in self.stage_infos)


def build_pipeline(
    model: nn.Module, pipe: PipelineConfig, pp_group: dist.ProcessGroup, device: torch.device,
    recipe: Callable[[nn.Module], nn.Module], dp_group: dist.ProcessGroup | None = None,
) -> PipelinedModel:
    """Split `model` into pipeline stages, keep this rank's, and pass each through `recipe`
    (the rest of smp's parallelism: FSDP over the stage's data-parallel ranks, ...). `dp_group`:
    the ranks of this stage that hold other rows of the batch (their gradients are averaged)."""
    pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    local = pipe.local_stages()
    parts = find_parts(model)
    check_layer_chain(model, parts)
    split = plan_split(model, pp * local, pipe.split)
    mine = [split[i] for i in stage_indices(pp_rank, pp, local, pipe.schedule in V_SCHEDULES)]
    ties = tied_names(model)  # before the recipe: FSDP / TP give each stage's copy its own tensor
    stages = [recipe(build_stage_module(model, parts, info)) for info in mine]
    for stage in stages:
        stage._smp_tied_names = ties  # the whole model's names of each tie (checkpoints, HF export and import)
    pipelined = PipelinedModel(stages, mine, split, pipe, pp_group, device, dp_group)
    targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    pipelined.tied = plan_ties(ties, stages, pp_group, targets) if ties else []
    return pipelined


def step(model: PipelinedModel, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
         attention_mask: torch.Tensor | None = None,
         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One training step (forward and backward of every micro-batch) on every rank of the
    pipeline; returns the whole batch's loss on every rank. Call `optimizer.step()` after it.

    `input_ids` and `labels` ([batch, seq]; labels default to input_ids) are this rank's
    data-parallel rows, the same on every pipeline rank. By default the loss is the next-token
    cross-entropy averaged over every target of the global batch (labels equal to -100 are
    ignored; the target count is summed over the micro-batches and the data-parallel ranks),
    exactly what `model(input_ids, attention_mask=..., labels=labels).loss` gives on the whole
    model and the whole batch. `attention_mask` ([batch, seq], 1 = token, 0 = padding) must pad
    on the right; its padding becomes labels of -100. A `loss_fn(logits, labels)` returning the
    mean over its micro-batch is averaged over the micro-batches (the batch mean when every
    micro-batch weighs the same).

    Under context parallel the rows are still whole (the same on every pipeline and cp rank):
    they are cut here for this cp rank, each stage gets the chunks' global position ids, and the
    labels are shifted over the whole row before the cut (docs/pipeline-parallel.md).
    """
    labels, microbatches = checked_batch(model, "smp.pipeline.step", input_ids, labels, attention_mask)
    cp = _context_parallel(model, loss_fn, input_ids.shape[1])  # refuses what it cannot carry, before any collective
    cp_size = 1 if cp is None else cp.size
    if model._schedule is None or model._loss_fn is not loss_fn:
        model._loss_fn = loss_fn
        model._schedule = model._build_schedule(microbatches)
    dp = 1 if model.dp_group is None else dist.get_world_size(model.dp_group)
    if loss_fn is None:
        # Divide by the target count of the whole batch (every micro-batch, every data-parallel
        # rank): ranks whose rows hold fewer targets (padding) weigh less, as in one process.
        # FSDP averages the data-parallel ranks' gradients, hence the factor dp (and cp: under
        # context parallel FSDP averages over dp_shard x cp, each cp rank holding part of each
        # row; the count is of the whole rows, which every cp rank holds here).
        targets = (labels[:, 1:] != IGNORE_INDEX).sum().to(model.device, torch.float64)
        if model.dp_group is not None:
            dist.all_reduce(targets, group=model.dp_group)
        model._scale = dp * cp_size / max(float(targets), 1.0)
    else:
        model._scale = 1.0 / microbatches
    input_ids, labels = input_ids.to(model.device), labels.to(model.device)
    stage_inputs: dict[str, torch.Tensor] = {}
    model._preshifted = cp is not None
    if cp is not None:
        # Each row cut once for this cp rank; every stage gets the chunks' global positions and
        # key padding mask (the schedule hands keyword inputs to every stage, split into
        # micro-batches like the ids).
        mask = None if attention_mask is None else attention_mask.to(model.device)
        input_ids, labels, stage_inputs = _rows_for_cp_rank(input_ids, labels, mask, cp)
    losses: list[torch.Tensor] = []
    before = set_aside(model.tied, list(model.stages))
    model._schedule.step(input_ids, target=labels, losses=losses, **stage_inputs)
    # A tied tensor (embedding and head) has a copy on two stages: each copy gets the sum.
    sum_tied_grads(model.tied, list(model.stages), model.pp_group, before)
    total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros((), device=model.device)
    # Only the rank holding the last stage has the losses: a sum over the pipeline gives it to all,
    # then the mean over the data-parallel ranks (each rank's share already weighed by dp).
    dist.all_reduce(total, group=model.pp_group)
    if model.dp_group is not None:
        dist.all_reduce(total, group=model.dp_group)
        total /= dp
    if cp is not None:  # likewise over the cp ranks, each holding part of every row
        dist.all_reduce(total, group=cp.group)
        total /= cp_size
    return total


def checked_batch(model: nn.Module, caller: str, input_ids: torch.Tensor, labels: torch.Tensor | None,
                  attention_mask: torch.Tensor | None, elsewhere: str = "") -> tuple[torch.Tensor, int]:
    """The labels `caller` (smp.pipeline.step / evaluate) scores (input_ids when none are given;
    padding made -100) and the micro-batch count, after the checks on the model and the batch
    that run before any collective. `elsewhere`: what to do with a model that is not pipelined."""
    if not isinstance(model, PipelinedModel):
        raise UsageError(
            f"{caller} expects the model smp.transform returned with pipeline_parallel_degree > 1, "
            f"got {type(model).__name__}{elsewhere}"
        )
    labels = input_ids if labels is None and attention_mask is None else labels
    if attention_mask is not None:
        labels = _padding_ignored(input_ids, labels, attention_mask)
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise UsageError(
            f"{caller} takes input_ids and labels of one shape [batch, seq]; got "
            f"{tuple(input_ids.shape)} and {tuple(labels.shape)}"
        )
    pp = dist.get_world_size(model.pp_group)
    try:
        check_pipeline(model.pipe, pp, batch_size=input_ids.shape[0])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return labels, model.pipe.microbatches or pp * len(model.stages)


def _context_parallel(model: PipelinedModel, loss_fn: Callable | None, seq_len: int) -> ContextParallelSetup | None:
    """The context parallel setup the stages attend under (None: context_parallel_degree 1),
    after refusing what the step cannot make exact under it."""
    setup = active_context_parallel()
    if setup is None or setup.size == 1:
        return None
    if not all(stage._smp_stage[1].hf for stage in model.stages):
        raise ConfigError(
            f"context_parallel_degree={setup.size} with pipeline_parallel_degree > 1 is built for transformers "
            f"causal LMs (their stages take global position_ids); a plain nn.Module's stages have no way to be "
            f"told where their chunk of each row sits. Set context_parallel_degree: 1 or pipeline_parallel_degree: 1"
        )
    if model.dp_group is not None:
        raise ConfigError(
            f"context_parallel_degree={setup.size} with pipeline_parallel_degree > 1 and "
            f"{dist.get_world_size(model.dp_group)} data-parallel ranks per stage is not supported: smp has proven "
            f"pipeline x context parallel with one data-parallel rank only; make pipeline_parallel_degree x "
            f"context_parallel_degree the world size, or set context_parallel_degree: 1"
        )
    if loss_fn is not None:
        raise UsageError(
            f"smp.pipeline.step: loss_fn with context_parallel_degree={setup.size} is not supported: the last "
            f"stage holds only this rank's chunks of each row, so a loss_fn(logits, labels) cannot shift labels "
            f"over the whole row; leave loss_fn out (the next-token cross-entropy over the whole rows)"
        )
    check_sequence_length(seq_len, setup.size, setup.load_balance)
    return setup


def _rows_for_cp_rank(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                      setup: ContextParallelSetup) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """This cp rank's chunks of whole rows (smp's context parallel layout): the token ids, the
    targets shifted over the whole row before the cut (the last token of a chunk predicts the
    first of the next), and every stage's inputs: the tokens' global positions and their padding
    mask (all ones without one: transformers reads position ids without a mask as packed
    sequences wherever they jump, as a chunk's do)."""
    index = chunk_positions(input_ids.shape[1], setup.size, setup.rank, setup.load_balance, device=input_ids.device)
    targets = shift_labels(labels, IGNORE_INDEX).index_select(1, index)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    stage_inputs = {
        "position_ids": index.expand(input_ids.shape[0], -1).contiguous(),
        "attention_mask": attention_mask.index_select(1, index),
    }
    return input_ids.index_select(1, index), targets, stage_inputs


def _padding_ignored(input_ids: torch.Tensor, labels: torch.Tensor | None,
                     attention_mask: torch.Tensor) -> torch.Tensor:
    """`labels` (default: input_ids) with the padding of a right-padded `attention_mask` set to
    -100. Stages run causal attention over whole rows: for a token followed only by padding that
    equals the masked attention, so the loss is exact; left padding (or holes) is refused."""
    if attention_mask.shape != input_ids.shape:
        raise UsageError(
            f"smp.pipeline.step: attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
            f"{tuple(input_ids.shape)}"
        )
    mask = attention_mask.to(torch.bool)
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise UsageError(
            "smp.pipeline.step takes right-padded rows only (attention_mask 1 ... 1 0 ... 0): pipeline "
            "stages run causal attention over the whole row, which equals the masked attention only "
            "for tokens that no padding precedes; pad on the right (tokenizer.padding_side = 'right')"
        )
    if labels is None:
        return input_ids.masked_fill(~mask, IGNORE_INDEX)
    # A target predicted from a padding position would need the mask: refuse it.
    if (~mask[:, :-1] & (labels[:, 1:] != IGNORE_INDEX)).any():
        raise UsageError(
            "smp.pipeline.step: labels at padding positions (attention_mask 0) must be -100: the "
            "stages do not mask attention, so a loss on padding would differ from the masked model's"
        )
    return labels
