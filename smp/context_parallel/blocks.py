"""Attention of local queries against one key/value block, as FlashAttention computes it: a
block's partial output with its log-sum-exp (lse), the exact merge of partials, and the exact
backward of one block given the merged output and lse.

Ring and all-gather attention both reduce to these three pieces: every rank attends its queries
to each rank's key/value block in turn and merges. The masks come from global token indices
(`segments`: the (start, length) runs of the sequence a rank holds), so causality, sliding
windows and key padding mean the same as in one process. Packed rows (several documents back to
back, position ids restarting at each) need no other message: every token carries the key of its
document, its global index minus its position id (docs/context-parallel.md), and a query sees a
key only when both keys are equal. Sub-blocks that the causal mask or the
window hide entirely are skipped: that is where load balancing pays (smp/context_parallel/sharding.py).

Shapes: q (B, Hkv, G, Lq, D) with G query heads per key/value head (GQA without repeating K/V),
k and v (B, Hkv, Lk, D); `keep` (B, Lk) float: each key's document key, NaN for padding (never
equal, so never seen); `q_docs` (B, Lq) float: each query's document key. Math in float32.
"""

from __future__ import annotations

import torch

Segments = list[tuple[int, int]]  # (first global token index, length), in the order held


def visible(q_seg: tuple[int, int], k_seg: tuple[int, int], causal: bool, window: int | None) -> bool:
    """Whether any query of `q_seg` may see any key of `k_seg` (else the sub-block is skipped)."""
    q0, q1 = q_seg[0], q_seg[0] + q_seg[1] - 1
    k0, k1 = k_seg[0], k_seg[0] + k_seg[1] - 1
    if causal and k0 > q1:
        return False
    if window is not None and k1 <= q0 - window:  # keys kept: k > q - window
        return False
    return True


def _mask(q_seg: tuple[int, int], k_seg: tuple[int, int], keep: torch.Tensor, q_docs: torch.Tensor,
          causal: bool, window: int | None) -> torch.Tensor:
    """Allowed (query, key) pairs of one sub-block: (B, 1, 1, Lq, Lk) bool; `keep` (B, Lk) and
    `q_docs` (B, Lq) are the sub-block's key and query document keys."""
    device = keep.device
    qi = torch.arange(q_seg[0], q_seg[0] + q_seg[1], device=device)[:, None]
    ki = torch.arange(k_seg[0], k_seg[0] + k_seg[1], device=device)[None, :]
    allowed = torch.ones(q_seg[1], k_seg[1], dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (ki <= qi)
    if window is not None:
        allowed = allowed & (ki > qi - window)
    same_document = keep[:, None, None, None, :] == q_docs[:, None, None, :, None]  # NaN: padding
    return allowed[None, None, None] & same_document


def _offsets(segments: Segments) -> list[int]:
    out, at = [], 0
    for _, length in segments:
        out.append(at)
        at += length
    return out


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                  q_segments: Segments, k_segments: Segments, *, q_docs: torch.Tensor, causal: bool,
                  window: int | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of `q` over one block: (out (B, Hkv, G, Lq, D), lse (B, Hkv, G, Lq)).
    Rows that see no key of this block get out 0 and lse -inf (they merge away)."""
    b, hkv, g, lq, d = q.shape
    out = q.new_zeros(b, hkv, g, lq, v.shape[-1])
    lse = q.new_full((b, hkv, g, lq), float("-inf"))
    for q_seg, qo in zip(q_segments, _offsets(q_segments)):
        q_part = q[..., qo:qo + q_seg[1], :]
        for k_seg, ko in zip(k_segments, _offsets(k_segments)):
            if not visible(q_seg, k_seg, causal, window):
                continue
            k_part = k[:, :, None, ko:ko + k_seg[1]]
            v_part = v[:, :, None, ko:ko + k_seg[1]]
            scores = (q_part @ k_part.transpose(-1, -2)) * scale
            allowed = _mask(q_seg, k_seg, keep[:, ko:ko + k_seg[1]], q_docs[:, qo:qo + q_seg[1]], causal, window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            part_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - _finite(part_lse)[..., None])
            part_out = probs @ v_part
            rows = slice(qo, qo + q_seg[1])
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], part_out, part_lse)
    return out, lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, q_docs: torch.Tensor, *,
           causal: bool, window: int | None, scale: float) -> torch.Tensor:
    """Attention of a whole sequence's queries over its keys (Ulysses, after the all-to-all),
    differentiable by autograd: (B, Hkv, G, S, D). Rows that see no key give 0."""
    length = q.shape[-2]
    scores = (q @ k[:, :, None].transpose(-1, -2)) * scale
    allowed = _mask((0, length), (0, length), keep, q_docs, causal, window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse)[..., None]) @ v[:, :, None]


def merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
          part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of two partial attentions over disjoint keys: each is weighted by its
    share exp(lse_i - lse) of the combined normaliser."""
    new_lse = torch.logaddexp(lse, part_lse)
    safe = _finite(new_lse)
    weight = torch.exp(lse - safe)[..., None]
    part_weight = torch.exp(part_lse - safe)[..., None]
    return out * weight + part_out * part_weight, new_lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, delta: torch.Tensor,
                   q_segments: Segments, k_segments: Segments, *, q_docs: torch.Tensor, causal: bool,
                   window: int | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block (dq contribution, dk, dv) given the MERGED out/lse of all blocks:
    the block's probabilities are exp(scores - lse), exactly its share of the full softmax.
    `delta` = rowsum(grad_out * out) (B, Hkv, G, Lq)."""
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    finite_lse = _finite(lse)
    for q_seg, qo in zip(q_segments, _offsets(q_segments)):
        rows = slice(qo, qo + q_seg[1])
        q_part, go, dl, row_lse = q[..., rows, :], grad_out[..., rows, :], delta[..., rows], finite_lse[..., rows]
        for k_seg, ko in zip(k_segments, _offsets(k_segments)):
            if not visible(q_seg, k_seg, causal, window):
                continue
            cols = slice(ko, ko + k_seg[1])
            k_part, v_part = k[:, :, None, cols], v[:, :, None, cols]
            scores = (q_part @ k_part.transpose(-1, -2)) * scale
            allowed = _mask(q_seg, k_seg, keep[:, cols], q_docs[:, rows], causal, window)
            probs = torch.exp(scores - row_lse[..., None]).masked_fill(~allowed, 0.0)
            dv[:, :, cols] += (probs.transpose(-1, -2) @ go).sum(2)
            dprobs = go @ v_part.transpose(-1, -2)
            dscores = probs * (dprobs - dl[..., None]) * scale
            dq[..., rows, :] += dscores @ k_part
            dk[:, :, cols] += (dscores.transpose(-1, -2) @ q_part).sum(2)
    return dq, dk, dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that saw no key) replaced by 0, so exp(x - lse) stays 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """One flat buffer of `tensors` (one message), in the first one's dtype."""
    return torch.cat([t.reshape(-1).to(tensors[0].dtype) for t in tensors])


def unpack(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(buffer[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out
