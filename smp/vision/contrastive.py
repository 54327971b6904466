"""Contrastive losses over the global batch (CLIP, SigLIP) when the batch is split over ranks.

A contrastive loss compares every image with every text of the batch (in-batch negatives).
With the batch split over data-parallel ranks, each rank sees only its own rows: a loss
computed on them has fewer negatives and differs from the one-process loss. `gather_with_grad`
concatenates every rank's embeddings with a differentiable all-gather (its backward sums each
rank's gradient for a row and hands it back to the rank that owns the row, as open_clip's
`gather_features`); every rank then computes the global-batch loss, which equals the
one-process loss, and FSDP's averaged reduction gives the one-process gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp import _compat


def gather_with_grad(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `t` concatenated along dim 0, in rank order, differentiable. Every rank must
    pass the same shape. Without a process group (one process) returns `t`."""
    if not (dist.is_available() and dist.is_initialized()):
        return t
    group = group if group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return t
    return _compat.all_gather_autograd(t, 0, group)


def clip_loss(image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale: torch.Tensor,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """CLIP's loss over the global batch from this rank's rows (`CLIPModel(return_loss=True)` on
    the whole batch): embeddings L2-normalised here, `logit_scale` the model's log-scale."""
    images = gather_with_grad(F.normalize(image_embeds, dim=-1), group)
    texts = gather_with_grad(F.normalize(text_embeds, dim=-1), group)
    logits = texts @ images.t() * logit_scale.exp()
    labels = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def siglip_loss(image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """SigLIP's sigmoid loss over the global batch from this rank's rows
    (`SiglipModel(return_loss=True)` on the whole batch)."""
    images = gather_with_grad(F.normalize(image_embeds, dim=-1), group)
    texts = gather_with_grad(F.normalize(text_embeds, dim=-1), group)
    logits = texts @ images.t() * logit_scale.exp() + logit_bias
    labels = 2 * torch.eye(len(logits), device=logits.device) - 1
    return -F.logsigmoid(labels * logits).sum(-1).mean()
