"""Context parallelism: each sequence split over the `cp` mesh axis (docs/context-parallel.md).

    batch = smp.context_parallel.shard_batch(rows)   # this rank's chunks, labels pre-shifted
    loss = model(**batch).loss                       # HF causal LMs; user models:
    # logits = model(batch["input_ids"], batch["position_ids"]); loss = token_loss(logits, batch)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from smp.context_parallel.apply import apply_context_parallel
from smp.context_parallel.attention import active, attention, deactivate
from smp.context_parallel.sharding import chunk_positions, chunk_segments, shift_labels, token_loss
from smp.context_parallel import sharding as _sharding


def shard_batch(batch: torch.Tensor | Mapping[str, Any]) -> dict[str, Any]:
    """This rank's chunks of a batch of full sequences, for the active context parallel run
    (the whole batch, labels shifted, when context parallel is off): see
    `smp.context_parallel.sharding.shard_batch`."""
    setup = active()
    if setup is None:
        return _sharding.shard_batch(batch, cp_size=1, cp_rank=0, load_balance=False)
    return _sharding.shard_batch(batch, cp_size=setup.size, cp_rank=setup.rank, load_balance=setup.load_balance)


__all__ = [
    "apply_context_parallel", "attention", "chunk_positions", "chunk_segments", "deactivate",
    "shard_batch", "shift_labels", "token_loss",
]
