"""The pipelined model a rank holds and the training step that runs torch's schedules over it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

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

from smp.anatomy import Anatomy
from smp.composition import row
from smp.config import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, PipelineConfig, check_pipeline
from smp.context_parallel.attention import ContextParallelSetup, active as active_context_parallel
from smp.context_parallel.sharding import (
    check_packed, check_sequence_length, chunk_positions, document_starts, shift_labels,
)
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


@dataclass
class PipelineOutput:
    """What calling a pipelined model returns (`outputs.loss`: the global batch's loss, on every
    rank), and what a `loss_fn(outputs, batch)` sees on the last stage (`outputs.logits`: one
    micro-batch's)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __getitem__(self, key: str) -> Any:  # outputs["loss"], as transformers' outputs allow
        return getattr(self, key)


@dataclass
class MicroBatchLoss:
    """The loss the last stage computes on each micro-batch during one run. `scale` makes the
    micro-batches' losses add up to this rank's share of the global batch's loss: the gradients
    FSDP then averages over the data-parallel ranks are those of the global mean."""

    scale: float
    preshifted: bool = False  # context parallel: the labels arrive shifted over the whole row
    loss_fn: Callable | None = None  # the user's loss_fn(outputs, batch), its batch {"labels": ...}

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(PipelineOutput(logits=logits), {"labels": labels})
        elif self.preshifted:  # position t of this rank's chunks predicts labels[t]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        else:  # next-token cross-entropy, summed (the scale divides by the global target count)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        return loss * self.scale


class PipelinedModel(nn.Module):
    """The stages of a model this rank holds (one, or several under virtual-stage schedules).

    Its parameters carry the whole model's names (`model.layers.5.mlp.up_proj.weight`): the
    stages hold disjoint slices, so `named_parameters` / `state_dict` are this rank's slice of the
    model's. Build the optimizer from `parameters()`. Train with `smp.step(model, batch)`, or
    call it like the whole model: `model(**batch)` with grad enabled runs the whole step (forward
    and backward of every micro-batch) and returns `.loss`, whose `.backward()` does nothing
    more; under `torch.no_grad()` it evaluates (docs/training-step.md).

    The model owns its schedules (one per batch shape, built on first use) and the loss
    its last stage computes, which `run` sets for the length of one step.
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
        self.tied: list[TiedGroup] = []  # tied tensors whose copies' gradients the step sums (smp.pipeline.tied)
        self._schedules: dict[tuple[int, ...], Any] = {}  # torch's schedule per (micro-batches, rows, seq)
        self._micro_loss: MicroBatchLoss | None = None  # the running step's loss; set by run() only

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

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **inputs: Any) -> PipelineOutput:
        """`model(**batch)` as a training loop written for the whole model calls it. With grad
        enabled: the whole training step (forward and backward of every micro-batch, as
        `smp.step`); the returned `.loss` is the global batch's mean on every rank, and its
        `.backward()` does nothing (the gradients are already in place). Under
        `torch.no_grad()`: the evaluation loss. A pipeline stage cannot hand back the whole
        model's logits, so the batch must carry `labels`."""
        if labels is None:
            raise UsageError(
                "a pipelined model (pipeline_parallel_degree > 1) called like the whole model needs labels: it runs "
                "the whole step over its stages and returns only the loss (no stage holds the whole model's "
                "logits); call model(input_ids=..., labels=...), or smp.step(model, batch)"
            )
        batch = {"input_ids": input_ids, "labels": labels, **inputs}
        if not torch.is_grad_enabled():
            return PipelineOutput(loss=self.run(batch, train=False, caller="model(**batch) under no_grad"))
        loss = self.run(batch, train=True, caller="model(**batch)")
        return PipelineOutput(loss=_GradientsInPlace.apply(torch.zeros((), requires_grad=True), loss))

    def describe_split(self) -> str:
        return "\n".join(s.describe() for s in self.split)

    # --- the step ------------------------------------------------------------------------------
    def _check_no_router_loss(self, caller: str) -> None:
        """smp.transform refuses a model whose config asks for its MoE load-balancing loss; the
        stages share that config with the model, so a switch turned on after the transform is
        seen here, before any stage runs, instead of the loss silently leaving the term out."""
        config = getattr(self.stages[0], "config", None)
        if getattr(config, "output_router_logits", False):
            refused = row("aux_loss", "pp")
            raise ConfigError(
                f"{caller}: the model's config.output_router_logits is True (set after smp.transform): its "
                f"load-balancing loss cannot be given under pipeline_parallel_degree > 1: {refused.reason}; {refused.fix}"
            )

    def run(self, batch: Mapping[str, Any], *, train: bool, loss_fn: Callable | None = None,
            scale: float = 1.0, caller: str = "smp.step") -> torch.Tensor:
        """One step over every micro-batch of `batch` (this rank's data-parallel rows, the same
        on every pipeline rank): forward and backward when `train`, forward only otherwise.
        Returns the global batch's loss on every rank; the gradients are those of `scale` x it.

        A batch whose rows do not split into the micro-batches is padded with rows whose
        labels are all ignored (they add nothing to the loss or the gradients)."""
        input_ids, labels, mask, positions = pipeline_batch(batch, caller)
        self._check_no_router_loss(caller)
        if positions is not None and not all(stage._smp_stage[1].hf for stage in self.stages):
            raise UsageError(
                f"{caller}: position_ids other than 0, 1, 2, ... along each row are built for transformers causal "
                f"LMs under pipeline parallelism (each stage hands them to the model's own forward); a plain "
                f"nn.Module's stages take only the hidden state, so they would number the tokens from 0. Leave "
                f"position_ids out, or set pipeline_parallel_degree: 1"
            )
        pp = dist.get_world_size(self.pp_group)
        microbatches = self.pipe.microbatches or pp * len(self.stages)
        rows = input_ids.shape[0]
        padded_rows = -(-rows // microbatches) * microbatches
        if padded_rows != rows and loss_fn is not None:
            raise UsageError(
                f"{caller}: a batch of {rows} rows does not split into pipeline.microbatches={microbatches}, and "
                f"with a loss_fn smp cannot pad it (your loss_fn would see rows that do not exist); pass a multiple "
                f"of {microbatches} rows, or leave loss_fn out (padding rows then carry only ignored labels)"
            )
        try:
            check_pipeline(self.pipe, pp, batch_size=padded_rows)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        cp = _context_parallel(self, loss_fn, input_ids.shape[1], caller)  # refusals, before any collective
        if cp is not None and positions is not None:  # smp's attention keys documents by index - position:
            check_packed(positions, mask, f"{caller} (context parallel)")  # a jump up could repeat a key
        cp_size = 1 if cp is None else cp.size
        dp = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        if loss_fn is None:
            # Divide by the target count of the whole batch (every micro-batch, every data-parallel
            # rank): ranks whose rows hold fewer targets (padding) weigh less, as in one process.
            # FSDP averages the data-parallel ranks' gradients, hence the factor dp (and cp: FSDP
            # averages over dp_shard x cp, each cp rank holding part of each row; the count is of
            # the whole rows, which every cp rank holds here).
            targets = global_target_count(labels, self.dp_group, self.device)
            micro_loss = MicroBatchLoss(scale * dp * cp_size / max(float(targets), 1.0), preshifted=cp is not None)
        else:  # the mean of loss_fn's micro-batch values (the batch mean when they weigh the same)
            micro_loss = MicroBatchLoss(scale / microbatches, loss_fn=loss_fn)
        input_ids, labels, mask, positions = _pad_rows(input_ids, labels, mask, positions, padded_rows)
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        positions = None if positions is None else positions.to(self.device)
        # The schedule hands keyword inputs to every stage, split into micro-batches like the ids.
        stage_inputs: dict[str, torch.Tensor] = {}
        if cp is not None:
            # Each row cut once for this cp rank; every stage gets the chunks' positions (global,
            # or the packed documents' own) and key padding mask.
            mask = None if mask is None else mask.to(self.device)
            input_ids, labels, stage_inputs = _rows_for_cp_rank(input_ids, labels, mask, positions, cp)
        elif positions is not None:
            # Packed rows: every stage gets the positions, from which transformers builds the
            # document-aware causal mask (no attention mask, no cache), as the whole model does.
            stage_inputs = {"position_ids": positions}
        losses: list[torch.Tensor] = []
        # torch's stages size their receive buffers on their first step: one schedule per shape.
        shape = (microbatches, *input_ids.shape)
        schedule = self._schedules.get(shape)
        if schedule is None:
            schedule = self._schedules[shape] = self._build_schedule(microbatches)
        self._micro_loss = micro_loss
        try:
            if train:
                before = set_aside(self.tied, list(self.stages))
                schedule.step(input_ids, target=labels, losses=losses, **stage_inputs)
                # A tied tensor (embedding and head) has a copy on two stages: each copy gets the sum.
                sum_tied_grads(self.tied, list(self.stages), self.pp_group, before)
            else:
                with torch.no_grad():
                    schedule.eval(input_ids, target=labels, losses=losses, **stage_inputs)
        finally:
            self._micro_loss = None
        total = (torch.stack([loss.detach().float() for loss in losses]).sum() if losses
                 else torch.zeros((), device=self.device))
        # Only the rank holding the last stage has the losses: a sum over the pipeline gives it to
        # all, then the mean over the data-parallel ranks (each rank's share already weighed by dp).
        dist.all_reduce(total, group=self.pp_group)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
            total /= dp
        if cp is not None:  # likewise over the cp ranks, each holding part of every row
            dist.all_reduce(total, group=cp.group)
            total /= cp_size
        return total / scale

    def _loss_of_microbatch(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._micro_loss is None:  # planning builds schedules it never steps
            raise UsageError("a pipelined model's schedule runs only inside smp.step / smp.evaluate")
        return self._micro_loss(logits, labels)

    def _build_schedule(self, microbatches: int) -> Any:
        pp = dist.get_world_size(self.pp_group)
        num_stages = pp * len(self.stages)
        torch_stages = [
            _Stage(stage, info.index, num_stages, self.device, group=self.pp_group)
            for stage, info in zip(self.stages, self.stage_infos)
        ]
        cls = SCHEDULE_CLASSES[self.pipe.schedule]
        # scale_grads=False: the loss is already divided so that the micro-batches sum to the
        # whole batch's loss (torch's default divides by the micro-batch count, which equals the
        # batch mean only when every micro-batch holds as many targets).
        loss = self._loss_of_microbatch
        if self.pipe.schedule in SINGLE_STAGE_SCHEDULES:
            return cls(torch_stages[0], n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
        return cls(torch_stages, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)

    def _holds_last(self) -> bool:
        return any(info.last for info in self.stage_infos)


class _Stage(PipelineStage):
    """torch's PipelineStage, whose hand-off of input gradients to the rank's previous stage
    does nothing when the schedule runs no backward. The V schedules (zbv_zero_bubble,
    dualpipev) hold two adjacent stages on one rank and, in `eval()`, still run their backward
    actions, which skip the backward but hand its (absent) gradients on: torch (2.13) asserts
    there, so smp.evaluate failed under them."""

    def get_local_bwd_output(self, mb_index: int) -> Any:
        return () if not self.has_backward else super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class _GradientsInPlace(torch.autograd.Function):
    """The loss `model(**batch)` returns: its value is the step's, its backward adds nothing (the
    step already ran every micro-batch's backward). A second backward, or one reached through
    arithmetic that scales it (`loss / accumulation_steps`), would mean gradients the step did
    not compute: refused."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.used = False
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        if ctx.used:
            raise UsageError(
                "backward() was called twice on the loss of a pipelined model's model(**batch): its gradients "
                "were computed once, during the call; call model(**batch) again for another step"
            )
        ctx.used = True
        if not torch.equal(grad, torch.ones_like(grad)):
            raise UsageError(
                f"the loss of a pipelined model's model(**batch) reached backward() with weight {float(grad):g}, "
                f"not 1 (scaled, e.g. loss / gradient_accumulation_steps, or combined with another term): its "
                f"gradients were computed at weight 1 during the call. Call loss.backward() on it as returned; "
                f"for accumulation use smp.step(model, batch, scale=1 / steps, accumulate=True)"
            )
        return None, None

def build_pipeline(
    model: nn.Module, pipe: PipelineConfig, pp_group: dist.ProcessGroup, device: torch.device,
    recipe: Callable[[nn.Module], nn.Module], dp_group: dist.ProcessGroup | None = None,
    anatomy: Anatomy | None = None,
) -> PipelinedModel:
    """Split `model` into pipeline stages, keep this rank's, and pass each through `recipe`
    (the rest of smp's parallelism: FSDP over the stage's data-parallel ranks, ...). `dp_group`:
    the ranks of this stage that hold other rows of the batch (their gradients are averaged).
    `anatomy`: the picture of `model` already taken (smp/anatomy.py)."""
    pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    local = pipe.local_stages()
    parts = find_parts(model, anatomy)
    check_layer_chain(model, parts)
    split = plan_split(model, pp * local, pipe.split, parts)
    mine = [split[i] for i in stage_indices(pp_rank, pp, local, pipe.schedule in V_SCHEDULES)]
    ties = tied_names(model)  # before the recipe: FSDP / TP give each stage's copy its own tensor
    stages = [recipe(build_stage_module(model, parts, info)) for info in mine]
    for stage in stages:
        stage._smp_tied_names = ties  # the whole model's names of each tie (checkpoints, HF export and import)
    pipelined = PipelinedModel(stages, mine, split, pipe, pp_group, device, dp_group)
    targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    pipelined.tied = plan_ties(ties, stages, pp_group, targets) if ties else []
    return pipelined


def global_target_count(labels: torch.Tensor, dp_group: dist.ProcessGroup | None,
                        device: torch.device) -> torch.Tensor:
    """The next-token targets (labels not -100 after the first position) of the rows every rank
    of `dp_group` holds, summed: what the global batch's mean loss divides by (float64)."""
    targets = (labels[:, 1:] != IGNORE_INDEX).sum().to(device, torch.float64)
    if dp_group is not None:
        dist.all_reduce(targets, group=dp_group)
    return targets


def step(model: PipelinedModel, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
         attention_mask: torch.Tensor | None = None,
         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Kept for one release: `smp.step(model, {"input_ids": ..., "labels": ...})` runs it.
    A `loss_fn(logits, labels)` here is a `loss_fn(outputs, batch)` there."""
    _check_pipelined(model, "smp.pipeline.step")
    batch = _legacy_batch(input_ids, labels, attention_mask)
    new_fn = None if loss_fn is None else (lambda outputs, mb: loss_fn(outputs.logits, mb["labels"]))
    return model.run(batch, train=True, loss_fn=new_fn, caller="smp.pipeline.step")


def _legacy_batch(input_ids: torch.Tensor, labels: torch.Tensor | None,
                  attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    batch = {"input_ids": input_ids}
    if labels is not None:
        batch["labels"] = labels
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    return batch


def _check_pipelined(model: nn.Module, caller: str, elsewhere: str = "") -> None:
    if not isinstance(model, PipelinedModel):
        raise UsageError(
            f"{caller} expects the model smp.transform returned with pipeline_parallel_degree > 1, "
            f"got {type(model).__name__}{elsewhere}"
        )


PIPELINE_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids")


def pipeline_batch(batch: Mapping[str, Any], caller: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The ids, the labels (input_ids when none are given; padding made -100), the right padding
    mask and the position ids (None when absent or 0, 1, 2, ... along each row; else [batch, seq])
    of a batch a pipelined model can run exactly, after the checks that run before any
    collective. Labels are used as given: like the whole model, the pipeline lets the last token
    of a packed document predict the next document's first token unless its label is -100 (as
    DataCollatorWithFlattening writes it)."""
    unknown = sorted(k for k, v in batch.items() if k not in PIPELINE_INPUTS and v is not None)
    if unknown:
        raise UsageError(
            f"{caller}: a pipelined model takes input_ids, labels, attention_mask and position_ids; the batch also "
            f"holds {unknown}, which smp has no rule to hand to the stages; leave them out of the batch"
        )
    input_ids, labels, attention_mask = batch.get("input_ids"), batch.get("labels"), batch.get("attention_mask")
    if not isinstance(input_ids, torch.Tensor):
        raise UsageError(f"{caller}: the batch needs input_ids, a [batch, seq] tensor of token ids")
    positions = _positions(batch.get("position_ids"), input_ids, attention_mask, caller)
    labels = input_ids if labels is None and attention_mask is None else labels
    if attention_mask is not None:
        labels = _padding_ignored(input_ids, labels, attention_mask, caller)
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise UsageError(
            f"{caller} takes input_ids and labels of one shape [batch, seq]; got "
            f"{tuple(input_ids.shape)} and {tuple(labels.shape)}"
        )
    return input_ids, labels, attention_mask, positions


def _positions(positions: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               caller: str) -> torch.Tensor | None:
    """The batch's position ids as every stage takes them ([batch, seq]), or None when the
    stages may count them (absent, or 0, 1, 2, ... along each row)."""
    if positions is None:
        return None
    if not isinstance(positions, torch.Tensor) or positions.dim() > 2 or input_ids.dim() != 2:
        raise UsageError(
            f"{caller}: a pipelined model takes position_ids of shape [batch, seq] (or [seq]) beside input_ids "
            f"[batch, seq]; got {getattr(positions, 'shape', type(positions).__name__)}"
        )
    try:
        positions = positions.expand_as(input_ids)
    except RuntimeError:
        raise UsageError(
            f"{caller}: position_ids {tuple(positions.shape)} do not match input_ids {tuple(input_ids.shape)}"
        ) from None
    counting = torch.arange(positions.shape[-1], device=positions.device)
    if torch.equal(positions, counting.expand_as(positions)):
        return None
    if attention_mask is not None and bool(document_starts(positions).any()):
        # The stages run without the mask (right padding is exact without it); with a mask the
        # whole model ignores the documents' boundaries, without one transformers honours them.
        raise UsageError(
            f"{caller}: the batch has packed rows (position_ids restart inside a row) and an attention_mask; with "
            f"a mask transformers attends across the documents' boundaries, which a pipeline's stages (run "
            f"without the mask) would not: drop attention_mask (pack without padding, as "
            f"DataCollatorWithFlattening does, or make the padding a document of its own with labels -100)"
        )
    return positions.contiguous()


def _pad_rows(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None,
              positions: torch.Tensor | None, rows: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The batch with rows appended up to `rows`: token 0, every label ignored, the mask all ones,
    positions counting 0, 1, 2, ... (a row that attends like any other, whose loss and gradients
    are zero)."""
    extra = rows - input_ids.shape[0]
    if extra == 0:
        return input_ids, labels, mask, positions
    input_ids = torch.cat([input_ids, input_ids.new_zeros(extra, input_ids.shape[1])])
    labels = torch.cat([labels, labels.new_full((extra, labels.shape[1]), IGNORE_INDEX)])
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(extra, mask.shape[1])])
    if positions is not None:
        counting = torch.arange(positions.shape[1], device=positions.device, dtype=positions.dtype)
        positions = torch.cat([positions, counting.expand(extra, -1)])
    return input_ids, labels, mask, positions


def _context_parallel(model: PipelinedModel, loss_fn: Callable | None, seq_len: int,
                      caller: str) -> ContextParallelSetup | None:
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
    if model.dp_group is not None:  # smp.init refuses it first (smp/composition.py); a hand-built pipeline here
        refused = row("pp", "cp", "dp")
        raise ConfigError(
            f"context_parallel_degree={setup.size} with pipeline_parallel_degree > 1 and "
            f"{dist.get_world_size(model.dp_group)} data-parallel ranks per stage is not supported: "
            f"{refused.reason}; {refused.fix}"
        )
    if loss_fn is not None:
        raise UsageError(
            f"{caller}: loss_fn with context_parallel_degree={setup.size} is not supported: the last "
            f"stage holds only this rank's chunks of each row, so a loss_fn cannot shift labels "
            f"over the whole row; leave loss_fn out (the next-token cross-entropy over the whole rows)"
        )
    check_sequence_length(seq_len, setup.size, setup.load_balance)
    return setup


def _rows_for_cp_rank(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                      positions: torch.Tensor | None, setup: ContextParallelSetup
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """This cp rank's chunks of whole rows (smp's context parallel layout): the token ids, the
    targets shifted over the whole row before the cut (the last token of a chunk predicts the
    first of the next), and every stage's inputs: the tokens' positions (global, or the packed
    documents' own: smp's attention reads the documents from them and the chunks' place) and
    their padding mask (all ones without one: transformers reads position ids without a mask as
    packed sequences wherever they jump, as a chunk's do)."""
    index = chunk_positions(input_ids.shape[1], setup.size, setup.rank, setup.load_balance, device=input_ids.device)
    targets = shift_labels(labels, IGNORE_INDEX).index_select(1, index)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    chunk = index.expand(input_ids.shape[0], -1) if positions is None else positions.index_select(1, index)
    stage_inputs = {
        "position_ids": chunk.contiguous(),
        "attention_mask": attention_mask.index_select(1, index),
    }
    return input_ids.index_select(1, index), targets, stage_inputs


def _padding_ignored(input_ids: torch.Tensor, labels: torch.Tensor | None,
                     attention_mask: torch.Tensor, caller: str) -> torch.Tensor:
    """`labels` (default: input_ids) with the padding of a right-padded `attention_mask` set to
    -100. Stages run causal attention over whole rows: for a token followed only by padding that
    equals the masked attention, so the loss is exact; left padding (or holes) is refused."""
    if attention_mask.shape != input_ids.shape:
        raise UsageError(
            f"{caller}: attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
            f"{tuple(input_ids.shape)}"
        )
    mask = attention_mask.to(torch.bool)
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise UsageError(
            f"{caller} takes right-padded rows only (attention_mask 1 ... 1 0 ... 0): pipeline "
            "stages run causal attention over the whole row, which equals the masked attention only "
            "for tokens that no padding precedes; pad on the right (tokenizer.padding_side = 'right')"
        )
    if labels is None:
        return input_ids.masked_fill(~mask, IGNORE_INDEX)
    # A target predicted from a padding position would need the mask: refuse it.
    if (~mask[:, :-1] & (labels[:, 1:] != IGNORE_INDEX)).any():
        raise UsageError(
            f"{caller}: labels at padding positions (attention_mask 0) must be -100: the "
            "stages do not mask attention, so a loss on padding would differ from the masked model's"
        )
    return labels
