"""Tiny models for tests and demos: a plain PyTorch transformer and a transformers Llama."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_in = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # -1, not d // heads: under tensor parallel attn_in yields only this rank's heads.
        q, k, v = self.attn_in(self.norm(x)).view(b, s, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn_out(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    """A user's own model: no transformers, blocks in an nn.ModuleList, untied head."""

    def __init__(self, vocab: int = 128, dim: int = 32, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(**overrides) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides))


def tiny_gpt2() -> nn.Module:
    """GPT-2: Conv1D layers (initialised in __init__) and an LM head tied to the embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout draws differ per rank
    ))


def build(kind: str) -> nn.Module:
    if kind == "plain":
        return TinyTransformer()
    if kind == "llama":
        return tiny_llama()
    if kind == "gpt2":
        return tiny_gpt2()
    raise ValueError(f"unknown test model {kind!r}")


def loss_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss for either kind of test model."""
    out = model(input_ids=input_ids, labels=input_ids if not isinstance(model, TinyTransformer) else None)
    if isinstance(out, torch.Tensor):  # TinyTransformer logits
        return F.cross_entropy(out[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    return out.loss


def pattern_batch(g: torch.Generator, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Even positions random, odd positions a fixed function of the previous token: half the
    tokens are learnable, so the loss falls from ln(V) to a floor near ln(V)/2, not to 0
    (a 1% gap between training runs is then a meaningful margin)."""
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    x[:, 1::2] = (x[:, 0::2] * 7 + 3) % vocab
    return x


def random_batch(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
