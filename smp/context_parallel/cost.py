"""What context parallel costs, by formula: bytes a rank moves per attention call, and the
attention work (query-key pairs computed) each rank does. `smp plan` and the benchmark use them.

Messages are float32 (smp's attention computes in fp32): K and V of one block are
2 x micro_batch x (seq_len / cp) x kv_dim elements, plus the block's key padding mask (which
also carries packed documents' keys). Ulysses moves query heads too (q_dim: heads x head dim).
"""

from __future__ import annotations

from smp.context_parallel.blocks import visible
from smp.context_parallel.sharding import chunk_segments

MESSAGE_BYTES = 4


def attention_bytes(algorithm: str, cp: int, micro_batch: int, seq_len: int, kv_dim: int,
                    q_dim: int | None = None) -> dict[str, int]:
    """Bytes one rank sends per attention call, forward and backward (see ring.py, allgather.py,
    ulysses.py); `q_dim` (query width, default kv_dim) counts for Ulysses only."""
    tokens = micro_batch * seq_len // cp
    kv = 2 * tokens * kv_dim  # K and V of one block
    block = kv + tokens  # ... with its key padding mask
    if cp == 1:
        return {"forward": 0, "backward": 0}
    if algorithm == "ulysses":
        # all-to-alls keep 1/cp of each tensor home: q, k, v out and the output back (forward),
        # the output's gradient out and dq, dk, dv back (backward); plus the padding/document
        # keys of every rank (all-gather, 2 values per token).
        q = tokens * (kv_dim if q_dim is None else q_dim)
        moved = (cp - 1) * (2 * q + kv) // cp
        return {"forward": (moved + (cp - 1) * 2 * tokens) * MESSAGE_BYTES, "backward": moved * MESSAGE_BYTES}
    if algorithm == "ring":
        forward = (cp - 1) * block
        backward = (cp - 1) * (block + kv) + kv  # block and its dK/dV on, then dK/dV home
    else:
        forward = (cp - 1) * block  # all-gather: every other rank's block
        backward = (cp - 1) * block + (cp - 1) * kv  # gather again, reduce-scatter dK/dV
    return {"forward": forward * MESSAGE_BYTES, "backward": backward * MESSAGE_BYTES}


def bytes_per_step(algorithm: str, cp: int, micro_batch: int, seq_len: int, kv_dim: int, layers: int,
                   recompute: bool = False, grad_accum: int = 1, q_dim: int | None = None) -> int:
    """Context parallel bytes per rank per optimizer step: every layer's attention, forward
    (twice under full activation checkpointing: recompute rings again) and backward."""
    per_call = attention_bytes(algorithm, cp, micro_batch, seq_len, kv_dim, q_dim)
    forwards = 2 if recompute else 1
    return grad_accum * layers * (forwards * per_call["forward"] + per_call["backward"])


def attention_pairs(seq_len: int, cp: int, rank: int, load_balance: bool, causal: bool = True,
                    window: int | None = None, computed: bool = False) -> int:
    """Query-key pairs rank `rank` attends (causal / window masks), or with `computed` the
    pairs of the sub-blocks it actually computes (fully hidden sub-blocks are skipped)."""
    mine = chunk_segments(seq_len, cp, rank, load_balance)
    total = 0
    for other in range(cp):
        for q_seg in mine:
            for k_seg in chunk_segments(seq_len, cp, other, load_balance):
                if not visible(q_seg, k_seg, causal, window):
                    continue
                if computed:
                    total += q_seg[1] * k_seg[1]
                    continue
                for q in range(q_seg[0], q_seg[0] + q_seg[1]):
                    lo = max(k_seg[0], q - window + 1) if window else k_seg[0]
                    hi = min(k_seg[0] + k_seg[1] - 1, q) if causal else k_seg[0] + k_seg[1] - 1
                    total += max(0, hi - lo + 1)
    return total
