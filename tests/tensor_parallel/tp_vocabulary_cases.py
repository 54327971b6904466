"""Tensor-parallel cases for the model families users bring (run on every rank of a RankPool;
each returns plain data). Tiny configs: hidden 64, 2 layers, 4 heads / 2 key-value heads,
vocab 256, 4 experts top-2; dropout 0 so that runs are deterministic."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import smp
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import random_batch

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 256
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)

# GPT-J ships no plan: the one a user writes for it.
GPTJ_PLAN = {
    "transformer.wte": "embedding_rowwise",
    "transformer.h.*.attn.q_proj": "colwise",
    "transformer.h.*.attn.k_proj": "colwise",
    "transformer.h.*.attn.v_proj": "colwise",
    "transformer.h.*.attn.out_proj": "rowwise",
    "transformer.h.*.mlp.fc_in": "colwise",
    "transformer.h.*.mlp.fc_out": "rowwise",
    "lm_head": "colwise_gather_output",
}


# GPT-OSS ships no TP plan. Its experts carry biases and are stored [experts, in, out] with gate
# and up interleaved; its attention's per-head `sinks` keep attention replicated here.
GPT_OSS_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.gate_up_proj_bias": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts.down_proj_bias": "rowwise",
    "lm_head": "colwise_gather_output",
}


def build(kind: str) -> nn.Module:
    import transformers as T

    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**_COMMON, head_dim=16))
    if kind == "gemma3":
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            **_COMMON, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    if kind == "qwen3_moe":  # layer 0 MoE, layer 1 dense (mlp_only_layers)
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_COMMON, **_MOE, head_dim=16, num_experts=4,
                                                      decoder_sparse_step=1, mlp_only_layers=[1]))
    if kind == "qwen2_moe":  # an unsplit shared expert beside the split experts
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**_COMMON, **_MOE, num_experts=4,
                                                      shared_expert_intermediate_size=64))
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2))
    if kind == "deepseek_v3":  # layer 0 dense, layer 1 MoE with split shared experts; MLA replicated
        common = dict(_COMMON, num_key_value_heads=4)
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **common, **_MOE, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_shared_experts=1))
    if kind == "phi3":  # fused qkv / gate_up, gathered (colwise_gather_output / rowwise_split_input)
        return T.Phi3ForCausalLM(T.Phi3Config(**_COMMON))
    if kind == "olmo2":  # full-width q_norm / k_norm on gathered q / k
        return T.Olmo2ForCausalLM(T.Olmo2Config(**_COMMON))
    if kind == "gpt_oss":
        model = T.GptOssForCausalLM(T.GptOssConfig(
            **dict(_COMMON, intermediate_size=32), head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
        with torch.no_grad():  # transformers inits biases to 0; a trained checkpoint's are not
            for n, p in model.named_parameters():
                if n.endswith("_bias"):
                    p.normal_(std=0.1)
        return model
    if kind == "gptj":
        return T.GPTJForCausalLM(T.GPTJConfig(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, rotary_dim=8,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if kind == "hy_v4":  # MLA + a top-k indexer whose forward runs under torch.no_grad
        from tests.models.model_coverage_cases import build_family

        return build_family("hy_v4")
    raise ValueError(kind)


def indexer_with_gradients_error(config: dict) -> str:
    """HY-V4 with its indexer's `@torch.no_grad()` taken off (its parameters then get partial
    gradients inside the split attention): smp must refuse, not replicate them."""
    from transformers.models.hy_v4 import modeling_hy_v4

    indexer = modeling_hy_v4.HYV4Indexer
    decorated = indexer.forward
    indexer.forward = decorated.__wrapped__
    try:
        return transform_error(config, "hy_v4")
    finally:
        indexer.forward = decorated


def plan_for(kind: str, plan: str) -> dict | None:
    """'own': the model's shipped plan (GPT-J: the user's); 'stripped': the shipped plan with its
    `replicated_with_grad_allreduce` entries removed, passed as a user plan (GPT-OSS: the user's
    plan without its expert-bias entries, which then follow their weights)."""
    if kind == "gptj":
        return GPTJ_PLAN
    if kind == "gpt_oss":
        return GPT_OSS_PLAN if plan == "own" else {k: v for k, v in GPT_OSS_PLAN.items() if not k.endswith("_bias")}
    if plan == "stripped":
        model = build(kind)
        return {k: v for k, v in model._tp_plan.items() if v != "replicated_with_grad_allreduce"}
    return None


def _break_partial_grad_sum() -> None:
    """Negative control: the per-head norms' gradients are declared whole (not summed)."""
    from torch.distributed.tensor import Replicate

    from smp.tensor_parallel.styles import ReplicatedPartialGrad

    ReplicatedPartialGrad.grad_placement = Replicate()


def _bias_added_on_every_rank(bias, first: bool):
    """Negative control: a row-wise expert bias added by every TP rank, then summed."""
    from torch.distributed.tensor import Partial

    return bias.to_local(grad_placements=[Partial()])


def equivalence(config: dict, kind: str, plan: str = "own", steps: int = 3, break_sync: bool = False,
                loss_context: bool = True, break_bias_once: bool = False) -> dict:
    """TP run vs the single-process run on the same init and global batch: the largest loss and
    gradient gaps over `steps` SGD steps, and what smp applied. `loss_context=False` runs the
    model's own `labels=` loss and its backward outside `smp.tensor_parallel.loss_parallel()`.
    `break_bias_once`: the negative control for row-wise expert biases (added on every rank)."""
    from smp.tensor_parallel import moe

    added_once = moe._added_once
    if break_bias_once:
        moe._added_once = _bias_added_on_every_rank
    try:
        return _equivalence(config, kind, plan, steps, break_sync, loss_context)
    finally:
        moe._added_once = added_once


def _equivalence(config: dict, kind: str, plan: str, steps: int, break_sync: bool, loss_context: bool) -> dict:
    from torch.distributed.tensor import Partial

    from smp.tensor_parallel.styles import ReplicatedPartialGrad

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = copy.deepcopy(reference)
        tp_plan = plan_for(kind, plan)
        if break_sync:
            _break_partial_grad_sum()
        try:
            model = smp.transform(model, tp_plan=tp_plan)
        finally:
            ReplicatedPartialGrad.grad_placement = Partial()
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
        context = smp.tensor_parallel.loss_parallel if loss_context else contextlib.nullcontext
        return {**sgd_comparison(model, reference, batch, steps, context), **applied_plan(model)}


def applied_plan(model: nn.Module) -> dict:
    """What smp applied: its plan per module and how many parameters are split over `tp`."""
    return {"tp_plan": dict(getattr(model, "_smp_tp_plan", {})), "sharded": sum(
        1 for p in model.parameters() if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()))}


def assert_matches_one_process(reports: list[dict], tol: float) -> None:
    """Every rank's loss and gradients within `tol` of one process (`sgd_comparison`'s report,
    naming the three worst gradients), and the run trains."""
    for report in reports:
        assert report["loss_diff"] < tol, report
        assert report["grad_diff"] < tol, sorted(report["grad_diffs"].items(), key=lambda kv: -kv[1])[:3]
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]  # it trains


def sgd_comparison(model: nn.Module, reference: nn.Module, batch: torch.Tensor, steps: int,
                   context=contextlib.nullcontext) -> dict:
    """`steps` SGD steps (lr 0.1) of the transformed `model` on this rank's rows of `batch` and of
    `reference` on all of it: the largest loss gap, the largest gradient gap per parameter and
    overall, the reference losses. A parameter without a gradient (an expert no token reached)
    counts as zero on both sides. `context` wraps the TP forward and backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    report = {"loss_diff": 0.0, "grad_diffs": {}, "losses": []}
    ref_params = dict(reference.named_parameters())
    for _ in range(steps):
        with context():
            ids = local_rows(batch)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        ref_loss = reference(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        report["losses"].append(float(ref_loss))
        report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
        for n, p in model.named_parameters():
            grad = torch.zeros(p.shape) if p.grad is None else full_tensor(p.grad)
            ref_grad = torch.zeros(p.shape) if ref_params[n].grad is None else ref_params[n].grad
            report["grad_diffs"][n] = max(report["grad_diffs"].get(n, 0.0), float((grad - ref_grad).abs().max()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    report["grad_diff"] = max(report["grad_diffs"].values())
    return report


def transform_error(config: dict, kind: str, plan: dict | None = None) -> str:
    """The smp.Error smp.transform raises for this model/config ('' if none)."""
    return error_of_transform(config, lambda: build(kind), plan)


def error_of_transform(config: dict, make_model, plan: dict | None) -> str:
    """`Type: message` of the smp.Error smp.transform raises for `make_model()` under the user
    plan `plan`, or '' if it raises none."""
    with smp.session(config):
        torch.manual_seed(0)
        model = make_model()
        try:
            smp.transform(model, tp_plan=plan)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""


def region_attrs(config: dict) -> dict:
    """GPT-J's attention after the transform: the per-rank head count it reads, and the model's
    own config left whole."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build("gptj"), tp_plan=GPTJ_PLAN)
        attn = model.transformer.h[0].attn
        return {"num_attention_heads": attn.num_attention_heads, "head_dim": attn.head_dim,
                "config_heads": model.config.n_head}
