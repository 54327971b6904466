"""Context parallel attention inside Hugging Face models, through transformers' attention
interface: smp registers "smp_cp" (an attention function and a mask function) and sets it as
the model's `config._attn_implementation`; the model's own modeling code then calls it.

The mask function hands the attention the 2-D padding mask of this rank's keys as it is: the
causal / sliding-window masks are built inside the attention from global token indices, and the
key padding travels with its key/value block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp.context_parallel.attention import attention
from smp.errors import ConfigError, UsageError

IMPLEMENTATION = "smp_cp"
# The keyword inputs of a causal LM's forward that only its loss reads (what shard_batch adds).
LOSS_INPUTS = ("labels", "shift_labels", "num_items_in_batch")

# Model-config settings whose attention smp cannot reproduce exactly across chunks.
_UNSUPPORTED_CONFIG = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "use_alibi": "ALiBi position biases",
    "alibi": "ALiBi position biases",
}


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def check_hf_model(model: nn.Module) -> None:
    """Raise ConfigError naming the cause when the model's attention cannot be replaced, or not
    exactly (before any collective)."""
    name = type(model).__name__
    if not type(model)._can_set_attn_implementation():
        raise ConfigError(
            f"context_parallel_degree > 1: {name} does not call its attention through "
            f"transformers' attention interface, so smp cannot replace it with context parallel "
            f"attention; use a model whose attention does, or context_parallel_degree: 1"
        )
    config = model.config
    for key, what in _UNSUPPORTED_CONFIG.items():
        if getattr(config, key, None):
            raise ConfigError(
                f"context_parallel_degree > 1: {name} uses {what} ({key}={getattr(config, key)!r}), "
                f"which smp's context parallel attention does not compute; use context_parallel_degree: 1"
            )
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ConfigError(
            f"context_parallel_degree > 1: {name} has attention_dropout={dropout}; dropout on "
            f"attention probabilities split across ranks cannot match one process: set it to 0"
        )


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, hf_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)


def use_context_parallel_attention(model: nn.Module) -> None:
    register()
    model.config._attn_implementation = IMPLEMENTATION


def padding_mask(batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None,
                 **_: Any) -> torch.Tensor | None:
    """transformers' mask hook: pass the 2-D key padding mask through (None: no padding)."""
    return attention_mask


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, is_causal: bool | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (B, H, L, D) in, ((B, L, H, D), no weights) out."""
    for unsupported in ("softcap", "position_bias", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise UsageError(f"context parallel attention cannot compute `{unsupported}` exactly across chunks")
    if dropout:
        raise UsageError(f"context parallel attention: dropout={dropout} on attention probabilities is not supported")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UsageError(
            "context parallel attention needs the 2-D padding mask (batch, keys), not a prepared "
            f"{attention_mask.dim()}-D mask: pass attention_mask as smp.context_parallel.shard_batch returns it"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attention(query, key, value, causal=causal, scale=scaling, sliding_window=sliding_window,
                    key_padding_mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None
