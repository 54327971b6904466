"""Which tokens of each sequence a cp rank holds, and a batch cut to them.

Without load balancing rank i holds the i-th of cp equal chunks. Under a causal mask the last
rank then attends to the whole sequence and the first to 1/cp of it (cp x 2 - 1 times less
work). With load balancing each sequence is cut into 2 x cp chunks and rank i holds chunks i
and 2cp-1-i: one early and one late chunk, the same attention work on every rank.

Everything position-dependent is decided globally, before the cut: labels are shifted on the
whole sequence (the last token of one chunk predicts the first token of the next), position
ids are the tokens' global positions, and the loss divides by the token count of the whole rows.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from smp.context_parallel.blocks import Segments
from smp.errors import UsageError

IGNORE_INDEX = -100


def chunk_segments(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool) -> Segments:
    """The (first global index, length) runs of a `seq_len` sequence that `cp_rank` holds."""
    check_sequence_length(seq_len, cp_size, load_balance)
    if not load_balance:
        length = seq_len // cp_size
        return [(cp_rank * length, length)]
    length = seq_len // (2 * cp_size)
    return [(cp_rank * length, length), ((2 * cp_size - 1 - cp_rank) * length, length)]


def chunk_positions(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token indices held by `cp_rank`, in order: (seq_len / cp_size,) int64."""
    runs = chunk_segments(seq_len, cp_size, cp_rank, load_balance)
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in runs])


def check_sequence_length(seq_len: int, cp_size: int, load_balance: bool) -> None:
    parts = 2 * cp_size if load_balance else cp_size
    if seq_len % parts:
        why = (f"2 x context_parallel_degree = {parts} chunks (context_parallel.load_balance: true)"
               if load_balance else f"context_parallel_degree = {parts} chunks")
        raise UsageError(
            f"context parallel: sequence length {seq_len} does not split into {why}; pad the "
            f"sequences to a multiple of {parts}"
        )


def document_keys(position_ids: torch.Tensor | None, index: torch.Tensor, batch: int) -> torch.Tensor:
    """Each token's document key, float (B, L): its global index minus its position id. In a
    packed row (positions restart at 0 at each document, +1 inside it) the key is the index of
    the document's first token, equal for the tokens of one document and different across
    documents; one unpacked document per row gives 0 everywhere. `index` (L,): the global
    indices of the tokens (chunk_positions). Exact in float32 below 2**24 tokens."""
    if position_ids is None:
        return torch.zeros(batch, index.numel(), device=index.device)
    return (index[None, :] - position_ids.to(index.device)).float()


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: True where a document begins inside a row (the position is not the previous
    one + 1), transformers' rule for packed rows; never at index 0."""
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def check_packed(position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 caller: str = "context parallel shard_batch") -> bool:
    """Whether rows are packed (several documents each); raises UsageError for what smp cannot
    split exactly: a position jumping up inside a row (document keys could repeat), or packed
    rows with an attention mask (transformers then ignores the documents' boundaries)."""
    starts = document_starts(position_ids)
    if not bool(starts.any()):
        return False
    jumps = position_ids[:, 1:] > position_ids[:, :-1] + 1
    if bool(jumps.any()):
        row, col = (int(i) for i in jumps.nonzero()[0])
        raise UsageError(
            f"{caller}: position_ids of row {row} jump from "
            f"{int(position_ids[row, col])} to {int(position_ids[row, col + 1])}; packed rows must "
            f"restart each document's positions at 0 (as DataCollatorWithFlattening does)"
        )
    if attention_mask is not None:
        raise UsageError(
            f"{caller}: the batch has packed rows (position_ids restart inside a "
            "row) and an attention_mask; with a mask transformers attends across the documents' "
            "boundaries, so one process and smp would differ: drop attention_mask (pack without "
            "padding, as DataCollatorWithFlattening does, or make the padding a document of its own "
            "with labels -100)"
        )
    return True


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets on the whole sequence: position t is trained to predict labels[t + 1];
    the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def shard_batch(batch: torch.Tensor | Mapping[str, Any], *, cp_size: int, cp_rank: int,
                load_balance: bool, ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """This cp rank's part of a batch of full sequences (the rows of its data-parallel rank).

    `batch`: input ids (B, S), or a mapping with `input_ids` and optionally `labels` (unshifted,
    as Hugging Face models take them; default: input ids with padding ignored),
    `attention_mask` (B, S; 1 = real token) and `position_ids`. Returns the keyword arguments of
    a Hugging Face causal LM: input_ids, position_ids (global), attention_mask (this rank's keys;
    the attention gathers the rest), labels and shift_labels (already shifted, so the model does
    not shift again) and num_items_in_batch (the rows' target count / cp, so that the cp ranks'
    gradients, averaged, are those of the mean over the whole rows).
    """
    fields = {"input_ids": batch} if isinstance(batch, torch.Tensor) else dict(batch)
    input_ids = fields["input_ids"]
    seq_len = input_ids.shape[1]
    check_sequence_length(seq_len, cp_size, load_balance)
    unknown = set(fields) - {"input_ids", "labels", "attention_mask", "position_ids"}
    if unknown:
        raise UsageError(f"context parallel shard_batch: no rule to split {sorted(unknown)} along the sequence")
    mask = fields.get("attention_mask")
    positions = fields.get("position_ids")
    packed = positions is not None and positions.dim() == 2 and check_packed(positions, mask)
    labels = fields.get("labels")
    if labels is None:
        labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, ignore_index)
        if packed:  # no document predicts the next one's first token (DataCollatorWithFlattening)
            labels = labels.masked_fill(document_starts(positions), ignore_index)
    targets = shift_labels(labels, ignore_index)
    if positions is None:
        positions = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)

    index = chunk_positions(seq_len, cp_size, cp_rank, load_balance, device=input_ids.device)
    local_targets = targets.index_select(1, index)
    out = {
        "input_ids": input_ids.index_select(1, index),
        "position_ids": positions.index_select(1, index),
        "labels": local_targets,
        "shift_labels": local_targets,
        "num_items_in_batch": (targets != ignore_index).sum() / cp_size,
    }
    if mask is not None:
        out["attention_mask"] = mask.index_select(1, index)
    return out


def token_loss(logits: torch.Tensor, batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The next-token loss of a model that returns logits, on a batch from `shard_batch`: this
    rank's summed token losses over `num_items_in_batch`, as Hugging Face models compute it."""
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), batch["shift_labels"].flatten().to(logits.device),
        ignore_index=ignore_index, reduction="sum",
    )
    return total / batch["num_items_in_batch"]
