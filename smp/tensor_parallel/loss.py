"""Loss parallel: cross-entropy on vocab-sharded logits, without gathering the full logits.

With `tensor_parallel: {loss_parallel: true}` the LM head returns its logits as a DTensor
sharded on the vocab dim (each rank holds batch x seq x vocab/tp). torch's `loss_parallel()`
makes `F.cross_entropy` compute the softmax denominators with two small all-reduces instead;
both the loss and its backward must run inside it:

    with smp.tensor_parallel.loss_parallel():
        loss = causal_lm_loss(model(ids), ids)           # any model returning logits
        loss.backward()

A transformers causal LM's own `labels=` loss needs no context: smp.transform swaps its loss
function for `vocab_parallel_cross_entropy` (`use_vocab_parallel_loss`), whose backward is
local, so `model(input_ids=ids, labels=ids).loss.backward()` works anywhere.

Outside TP, or with loss_parallel off, the context does nothing, so one script serves all.
`loss_parallel_if(enabled)` here takes that decision as a value; `smp.tensor_parallel.loss_parallel()`
reads it from smp's run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel


def loss_parallel_if(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """torch's `loss_parallel()` when `enabled` (the logits are vocab-sharded), else a context
    that does nothing."""
    return _torch_loss_parallel() if enabled else contextlib.nullcontext()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy: position t predicts labels[t + 1]. Works on plain logits
    and (inside `loss_parallel()`) on vocab-sharded DTensor logits."""
    shifted = logits[:, :-1].flatten(0, 1).float()
    target = labels[:, 1:].flatten().to(shifted.device)
    return F.cross_entropy(shifted, target, ignore_index=ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `logits` split on the vocab dim over `group` (each rank holds
    columns [start, start + V/tp)), without gathering them: the max and the softmax denominator
    are all-reduced, and each rank contributes the target logit when it holds the target. Its
    backward is local (softmax - one-hot on this rank's columns), so it needs no context."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int, group) -> torch.Tensor:
        logits = logits.float()
        max_logit = logits.max(dim=-1).values
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logit.unsqueeze(-1)
        exp = shifted.exp()
        denom = exp.sum(dim=-1)
        dist.all_reduce(denom, group=group)
        local_target = target - start
        mine = (local_target >= 0) & (local_target < logits.shape[-1]) & (target != ignore_index)
        index = torch.where(mine, local_target, torch.zeros_like(local_target))
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        valid = target != ignore_index
        loss = ((denom.log() - target_logit) * valid).sum()
        ctx.save_for_backward(exp / denom.unsqueeze(-1), index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, index.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g * (valid.to(g.dtype) * grad).unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor, labels: torch.Tensor, ignore_index: int = -100, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """F.cross_entropy(logits.flatten(0, -2), labels.flatten()) for vocab-sharded DTensor logits
    (mean over non-ignored labels, or sum / num_items_in_batch), as a plain tensor."""
    mesh = logits.device_mesh
    local = logits.to_local()
    vocab, tp, rank = logits.shape[-1], mesh.size(), mesh.get_local_rank()
    start = rank * (-(-vocab // tp))  # Shard: the first ranks hold ceil(V / tp) columns each
    target = labels.reshape(-1).to(local.device)
    total = _VocabParallelCrossEntropy.apply(local.reshape(-1, local.shape[-1]), target, start, ignore_index, mesh.get_group())
    if num_items_in_batch is not None:
        return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return total / (target != ignore_index).sum()


def use_vocab_parallel_loss(model: nn.Module) -> None:
    """Make a transformers causal LM's own `labels=` loss work on its vocab-sharded logits, with
    or without `loss_parallel()` around it: its `loss_function` (transformers'
    `ForCausalLMLoss` for causal LMs) is wrapped to compute sharded logits with
    `vocab_parallel_cross_entropy`, same shift, `ignore_index` and `num_items_in_batch` as
    transformers; plain logits go to the original."""
    if not hasattr(type(model), "loss_function"):
        return
    original = model.loss_function
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        return  # only the causal-LM loss is rewritten; others see vocab-sharded logits as before

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        if not isinstance(logits, DTensor):
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return vocab_parallel_cross_entropy(logits, shift_labels, ignore_index, num_items_in_batch)

    model.loss_function = loss_function
