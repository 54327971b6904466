"""Loss parallel: cross-entropy on vocab-sharded logits, without gathering the full logits.

With `tensor_parallel: {loss_parallel: true}` the LM head returns its logits as a DTensor
sharded on the vocab dim (each rank holds batch x seq x vocab/tp). torch's `loss_parallel()`
makes `F.cross_entropy` compute the softmax denominators with two small all-reduces instead;
both the loss and its backward must run inside it:

    with smp.tensor_parallel.loss_parallel():
        loss = model(input_ids=ids, labels=ids).loss     # HF causal LMs: their own loss works
        # or: loss = causal_lm_loss(model(ids), ids)     # any model returning logits
        loss.backward()

Outside TP, or with loss_parallel off, the context does nothing, so one script serves all.
`loss_parallel_if(enabled)` here takes that decision as a value; `smp.tensor_parallel.loss_parallel()`
reads it from smp's run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
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
