"""Tensor-parallel cases for multi-head latent attention (`mla_kv_a_proj`), run on every rank of
a RankPool; each returns plain data. Tiny configs: hidden 64, 2 layers, 4 heads, vocab 256,
latents 16 wide, rotary key 8 wide; dropout 0 so that runs are deterministic."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate

import smp
from smp.testing.models import random_batch
from tests.tensor_parallel.tp_vocabulary_cases import applied_plan, error_of_transform, sgd_comparison

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 256
_MLA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=128, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)


def build(kind: str) -> nn.Module:
    import transformers as T

    if kind == "minicpm3":  # queries through q_a_proj -> q_a_layernorm -> q_b_proj
        return T.MiniCPM3ForCausalLM(T.MiniCPM3Config(**_MLA, q_lora_rank=16))
    if kind == "deepseek_v2":  # queries through one colwise q_proj; MoE MLP (layer 1)
        return T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
            **_MLA, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1))
    raise ValueError(kind)


def equivalence(config: dict, kind: str, steps: int = 3, break_rope_sum: bool = False) -> dict:
    """TP run of the model's own plan vs one process on the same init and global batch: the
    largest loss and per-parameter gradient gaps over `steps` SGD steps, and what smp applied.
    `break_rope_sum`: the negative control, the rotary key's partial gradient left unsummed."""
    from smp.tensor_parallel.styles import MlaKvAProj

    MlaKvAProj.rope_grad_placement = Replicate() if break_rope_sum else Partial()
    try:
        with smp.session(config):
            torch.manual_seed(smp.state.config.random_seed)
            reference = build(kind)
            model = smp.transform(copy.deepcopy(reference))
            batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
            return {**sgd_comparison(model, reference, batch, steps), **applied_plan(model)}
    finally:
        MlaKvAProj.rope_grad_placement = Partial()


def transform_error(config: dict, kind: str, plan: dict) -> str:
    """The smp.Error smp.transform raises for this model and user plan ('' if none)."""
    return error_of_transform(config, lambda: build(kind), plan)
