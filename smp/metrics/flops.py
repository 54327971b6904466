"""FLOPs per token of a model, and MFU (the formula: see smp/metrics/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOPs formula needs to know about a model."""

    matmul_params: int  # matmul weights a token uses (`count_matmul_params`): LM head in, embeddings out
    layers: int
    attention_width: int  # heads x head_dim (query side)

    def per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.attention_width * seq_len


def _full_numel(t: torch.Tensor) -> int:
    return t.numel()  # a DTensor's numel is its global (unsharded) size


def _moe_routing(model: nn.Module) -> tuple[int, int]:
    """(top_k, E) of an MoE model's config: each token runs through top_k of its E experts.
    (1, 1) for a dense model."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    # Mixtral names the expert count num_local_experts; Qwen2-MoE and others num_experts.
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return 1, 1
    return int(top_k), int(experts)


def count_matmul_params(model: nn.Module) -> int:
    """Weights a token multiplies through, each tensor counted once (sharded or not).

    - 2-D parameters: nn.Linear and transformers' Conv1D (GPT-2) weights, fused / packed
      projections (qkv, gate_up) included, the LM head (tied to the input embedding or not),
      and weights a module applies itself with F.linear (MoE routers);
    - 3-D parameters: E experts stacked [E, out, in] (transformers 5.x MoE: `experts.gate_up_proj`,
      `experts.down_proj`), of which a token uses top_k: top_k / E of them count, from the
      config's `num_experts_per_tok` and `num_local_experts` / `num_experts`;
    - embedding tables are a lookup, not a matmul; 1-D parameters (norms, biases) neither.
    """
    top_k, experts = _moe_routing(model)
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue  # a tied head's weight is counted by the head module
        for param in module.parameters(recurse=False):
            if id(param) in seen or param.dim() not in (2, 3):
                continue
            seen.add(id(param))
            total += _full_numel(param) if param.dim() == 2 else _full_numel(param) // experts * top_k
    return total


def model_flops(model: nn.Module, *, layers: int | None = None, heads: int | None = None,
                head_dim: int | None = None) -> ModelFlops:
    """ModelFlops of a transformers model (shape read from `model.config`) or of any model
    whose layer count, head count and head size are given."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    layers = layers if layers is not None else getattr(cfg, "num_hidden_layers", None)
    heads = heads if heads is not None else getattr(cfg, "num_attention_heads", None)
    if head_dim is None and cfg is not None:
        head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads)
    if layers is None or heads is None or head_dim is None:
        raise ValueError(
            "model_flops needs the layer count, head count and head size: pass layers=, heads=, "
            "head_dim= for a model without a transformers config"
        )
    return ModelFlops(count_matmul_params(model), int(layers), int(heads) * int(head_dim))


def mfu(achieved_flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None when the peak is unknown (blank, not guessed)."""
    if not peak:
        return None
    return achieved_flops_per_s / peak
