"""Training-loop helpers that must know about sharding: one training step for every layout
(`smp.step` / `smp.evaluate`), gradient clipping and accumulation."""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from smp import runtime
from smp.context_parallel import sharding as context_parallel_sharding
from smp.context_parallel.attention import ContextParallelSetup, active as active_context_parallel
from smp.context_parallel.hf import is_hf_model
from smp.errors import ConfigError, UsageError
from smp.expert_parallel.load_balancing import summed_over
from smp.mesh import device_type_for
from smp.pipeline import schedule as pipeline_schedule
from smp.pipeline.schedule import PipelinedModel
from smp.tensor_parallel.loss import loss_parallel_if


@torch.no_grad()
def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by their global norm across every shard and TP rank; returns the norm.

    Sharded (DTensor) gradients contribute their local part, summed over the mesh dims they
    are sharded on; replicated ones count once; a pipelined model's stages are summed over the
    pipeline ranks (pass the model, not its parameters). Equal to
    `torch.nn.utils.clip_grad_norm_` on the unsharded model.
    """
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    # A pipelined model's tied tensor (embedding and head) has a copy on two pipeline ranks
    # holding one gradient: its norm counts one copy.
    skip = model_or_params.norm_skip() if hasattr(type(model_or_params), "norm_skip") else set()
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    norm_type = float(norm_type)
    is_max = math.isinf(norm_type)
    # One reduction per (mesh, placements) group instead of one collective per parameter:
    # each group's local sum of |g|^p (or max) is all-reduced over the mesh dims it is sharded on.
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    totals = []
    for g in counted:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            # A pending (partial) sum: norms of the parts are not the norm of the sum.
            totals.append(_reduce_local(torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).full_tensor(), norm_type))
        elif isinstance(g, DTensor):
            groups[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            groups[()].append(g)
    for key, tensors in groups.items():
        local = _reduce_local(torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in tensors]), norm_type)
        if key:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():  # Shard or _StridedShard (FSDP over TP)
                    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
                    dist.all_reduce(local, op=op, group=mesh.get_group(dim))
        totals.append(local)
    if not totals:  # every gradient of this rank is counted on another pipeline rank
        totals.append(torch.zeros((), device=grads[0].device))
    stacked = torch.stack([t.to(totals[0].device) for t in totals])
    local = stacked.max() if is_max else stacked.sum()
    # A pipelined model holds one slice of the layers per pipeline rank: add up the stages.
    pp_group = getattr(model_or_params, "pp_group", None)
    if pp_group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=pp_group)
    total = local if is_max else local.pow(1.0 / norm_type)
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(clip_coef.to(g.device))
    return total


def _reduce_local(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Combine per-tensor norms into max (inf-norm) or the sum of p-th powers."""
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward passes inside skip the reduce-scatter / all-reduce.

    Gradients stay unsharded and local until the first backward outside the context, which
    syncs the accumulated sum once. Costs one unsharded gradient copy of device memory.
    """
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def all_reduce_mean(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Average a scalar (e.g. the loss, for logging) over the ranks of `group` (default: all).

    The tensor lives where `group`'s backend runs collectives: an NCCL group has no CPU
    backend, so on the current CUDA device (the one smp.init set); else on the CPU.
    """
    device = device_type_for(dist.get_backend(group)) if dist.is_initialized() else "cpu"
    t = torch.as_tensor(value).detach().to(device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return float(t)


# ----------------------------------------------------------------------------------------------
# One training step for every layout (docs/training-step.md)

IGNORE_INDEX = -100  # label value that contributes no loss (transformers' convention)


LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]  # loss_fn(outputs, batch) -> scalar


@dataclass(frozen=True)
class DataRanks:
    """Where the rows of the global batch lie, for a model every rank runs whole: the
    data-parallel group (None: one rank), the context parallel setup (None: off), and whether
    the logits come vocab-sharded (tensor_parallel.loss_parallel)."""

    dp_group: dist.ProcessGroup | None
    dp: int
    cp: ContextParallelSetup | None
    loss_parallel: bool
    device: torch.device

    @property
    def count(self) -> int:
        """The ranks FSDP averages the gradients over: every data-parallel rank, times cp."""
        return self.dp * (1 if self.cp is None else self.cp.size)


def _data_ranks() -> DataRanks:
    """The running session's DataRanks (read by the entry points, handed down as a value)."""
    state = runtime.current()
    cp = active_context_parallel()
    return DataRanks(
        dp_group=state.dp_mesh.get_group() if state.dims.dp > 1 else None, dp=state.dims.dp,
        cp=None if cp is None or cp.size == 1 else cp,
        loss_parallel=state.dims.tp > 1 and state.config.tensor_parallel.loss_parallel, device=state.device,
    )


def step(model: nn.Module, batch: Mapping[str, Any], *, loss_fn: LossFn | None = None,
         accumulate: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of `batch` on the model smp.transform returned, whatever its layout
    (FSDP, tensor / sequence / loss parallel, context parallel, expert parallel, pipeline
    parallel and their compositions). Returns the global batch's loss on every rank (detached);
    the gradients are in place (of `scale` x that loss). Call `optimizer.step()` after it.

    `batch`: this rank's data-parallel rows, whole (`input_ids`, `labels` unshifted as
    transformers takes them, default input_ids; optional `attention_mask`, `position_ids`, any
    other input of the model). Every tp, cp and pipeline rank of a data-parallel group passes the
    same rows: context parallel cuts them here, the pipeline splits them into micro-batches.

    The default loss is the next-token cross-entropy averaged over every non-ignored target of
    the global batch (all data-parallel ranks, labels of -100 ignored): the one-process model's
    `.loss` on the whole batch. `loss_fn(outputs, batch)` replaces it: its value on each rank's
    rows (each micro-batch's under pipeline parallelism) is averaged over them.
    `accumulate=True`: more steps follow before `optimizer.step()`; the gradient sync waits
    (smp.no_sync), the gradients add up.
    """
    if scale <= 0:
        raise UsageError(f"smp.step: scale must be positive, got {scale}")
    with no_sync(model) if accumulate else nullcontext():
        if isinstance(model, PipelinedModel):
            return model.run(batch, train=True, loss_fn=loss_fn, scale=scale, caller="smp.step")
        return _whole_model_step(model, batch, _data_ranks(), loss_fn, scale, train=True, caller="smp.step")


def evaluate(model: nn.Module, batch: Mapping[str, Any], *, loss_fn: LossFn | None = None) -> torch.Tensor:
    """`smp.step`'s forward-only twin: the global batch's loss on every rank, gradients
    untouched. Put the model in eval mode first when its forward has dropout."""
    with torch.no_grad():
        if isinstance(model, PipelinedModel):
            return model.run(batch, train=False, loss_fn=loss_fn, caller="smp.evaluate")
        return _whole_model_step(model, batch, _data_ranks(), loss_fn, 1.0, train=False, caller="smp.evaluate")


def _whole_model_step(model: nn.Module, batch: Mapping[str, Any], ranks: DataRanks, loss_fn: LossFn | None,
                      scale: float, train: bool, caller: str) -> torch.Tensor:
    """A model every rank runs whole (FSDP, TP, CP, EP): this rank's share of the global loss,
    weighed so that the gradient mean FSDP takes over the data ranks is the global one."""
    cp = ranks.cp
    _check_auxiliary_loss(model, ranks.count, caller)
    _check_takes_loss_count(model, loss_fn is None, caller)
    inputs = _with_labels(batch, caller)
    # The global batch's target count, summed over the data-parallel ranks (cp ranks hold the same rows).
    targets = pipeline_schedule.global_target_count(inputs["labels"], ranks.dp_group, ranks.device)
    # Each rank's loss is its summed token losses over count / ranks: their mean is the global mean.
    share = targets.clamp(min=1.0).float() / ranks.count
    if cp is not None:  # this rank's chunks of each row, labels shifted over the whole row first
        inputs = context_parallel_sharding.shard_batch(inputs, cp_size=cp.size, cp_rank=cp.rank,
                                                       load_balance=cp.load_balance)
    # transformers' name for the count a summed loss divides by: the model's own loss, and a
    # loss_fn that divides its sum by it, weigh every target of the global batch alike.
    inputs["num_items_in_batch"] = share
    outputs = _call_model(model, inputs, caller)
    with loss_parallel_if(ranks.loss_parallel):  # vocab-sharded logits: the loss and its backward inside
        if loss_fn is not None:
            loss = loss_fn(outputs, inputs)
        elif is_hf_model(model):
            loss = outputs.loss
        else:
            loss = _summed_token_loss(outputs, inputs) / share
        if train:
            (loss * scale).backward()
    total = loss.detach().float()
    # A loss over vocab-sharded logits is a replicated DTensor: its value is on every tp rank.
    total = (total.full_tensor() if isinstance(total, DTensor) else total).clone()
    if ranks.dp_group is not None:
        dist.all_reduce(total, group=ranks.dp_group)
    if cp is not None:
        dist.all_reduce(total, group=cp.group)
    return total / ranks.count


def _with_labels(batch: Mapping[str, Any], caller: str) -> dict[str, Any]:
    """The batch with `labels`: input_ids (padding of an attention_mask ignored) when it has none."""
    inputs = dict(batch)
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise UsageError(f"{caller}: the batch needs input_ids, a [batch, seq] tensor of token ids")
    if inputs.get("labels") is None:
        mask = inputs.get("attention_mask")
        inputs["labels"] = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    if inputs["labels"].shape != ids.shape:
        raise UsageError(
            f"{caller}: labels {tuple(inputs['labels'].shape)} must have input_ids' shape {tuple(ids.shape)} "
            f"(unshifted: smp shifts them, as transformers' causal LMs do); for a model with other labels call "
            f"model(**batch) and backward() yourself"
        )
    return inputs


def _check_auxiliary_loss(model: nn.Module, data_ranks: int, caller: str) -> None:
    """A mixture-of-experts load-balancing loss is a function of the routing of every token of
    the batch: the mean of its per-rank values is not the one-process value. smp.transform sums
    its router statistics over the data-parallel ranks (expert_parallel/load_balancing.py), which
    makes every rank's value and, once FSDP averages the ranks' gradients, its gradient the
    one-process ones; refused where that sum is not installed, or cannot be (context parallel:
    the composition table's reason and fix)."""
    config = getattr(model, "config", None)
    if data_ranks == 1 or not getattr(config, "output_router_logits", False):
        return
    summed = summed_over(model)
    if isinstance(summed, str):
        raise ConfigError(f"{caller}: {summed}")
    if summed is None:
        raise UsageError(
            f"{caller}: {type(model).__name__} adds the experts' load-balancing loss "
            f"(config.output_router_logits=True), computed over each rank's tokens, which over {data_ranks} "
            f"data-parallel ranks is not the whole batch's, and smp has not summed its router statistics over "
            f"the ranks (it does for a model smp.transform made whose family uses transformers' "
            f"load_balancing_loss_func); pass the model smp.transform returned, set "
            f"model.config.output_router_logits = False, or add to a loss_fn "
            f"smp.expert_parallel.global_load_balancing_loss(router_logits, num_experts, top_k, group=...)"
        )


def _takes_loss_count(model: nn.Module) -> bool:
    """Whether a transformers model's forward takes `num_items_in_batch` (causal LMs: through **kwargs)."""
    params = inspect.signature(model.forward).parameters
    return "num_items_in_batch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether a transformers model's forward takes `use_cache`: by name, or through **kwargs
    when its config has the switch (GraniteMoE's causal LM passes it on to its base model so)."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return takes_kwargs and getattr(getattr(model, "config", None), "use_cache", None) is not None


def _check_takes_loss_count(model: nn.Module, needs_count: bool, caller: str) -> None:
    if needs_count and is_hf_model(model) and not _takes_loss_count(model):
        raise UsageError(
            f"{caller}: {type(model).__name__}.forward takes no num_items_in_batch, the global target count smp "
            f"divides its loss by (transformers' causal LMs take it); pass a loss_fn(outputs, batch), or call "
            f"model(**batch) and backward() yourself"
        )


def _call_model(model: nn.Module, inputs: Mapping[str, Any], caller: str) -> Any:
    """The model's outputs: a transformers model gets the batch (with `num_items_in_batch` when
    its forward takes it), any other model the inputs its forward names."""
    if not is_hf_model(model):
        return _call_plain(model, inputs, caller)
    if "use_cache" not in inputs and _takes_use_cache(model):
        # A step never reads a cache; transformers builds one when use_cache is on (its configs'
        # default), and then ignores the document boundaries of packed position_ids.
        inputs = {**inputs, "use_cache": False}
    if _takes_loss_count(model):
        return model(**inputs)
    return model(**{k: v for k, v in inputs.items() if k != "num_items_in_batch"})


def _call_plain(model: nn.Module, inputs: Mapping[str, Any], caller: str) -> Any:
    """A model that is not a transformers model, called with the inputs its forward names
    (the labels are smp's to score)."""
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    loss_only = ("labels", "shift_labels", "num_items_in_batch")
    kwargs = {k: v for k, v in inputs.items() if k not in loss_only and (takes_any or k in params)}
    dropped = sorted(set(inputs) - set(kwargs) - set(loss_only))
    if dropped:
        raise UsageError(
            f"{caller}: {type(model).__name__}.forward takes no {dropped}, which the batch holds; leave them out of "
            f"the batch, or pass a loss_fn and a forward that takes them"
        )
    return model(**kwargs)


def _summed_token_loss(outputs: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The summed next-token cross-entropy of a model's logits (a tensor, or `.logits`)."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    if "shift_labels" in inputs:  # context parallel: already shifted over the whole row
        shifted, targets = logits, inputs["shift_labels"]
    else:
        shifted, targets = logits[:, :-1], inputs["labels"][:, 1:]
    total = F.cross_entropy(shifted.flatten(0, 1).float(), targets.flatten().to(shifted.device),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    # Under loss_parallel() the sum over vocab-sharded logits is a replicated DTensor.
    return total.full_tensor() if isinstance(total, DTensor) else total
