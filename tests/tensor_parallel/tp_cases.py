"""Tensor-parallel cases that run on every rank of a RankPool; each returns plain data."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import smp
from smp.tensor_parallel import causal_lm_loss, loss_parallel
from smp.testing.distributed import full_tensor, local_rows, max_grad_diff, world_mean
from smp.testing.models import TinyTransformer, random_batch, tiny_llama

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 128

# The user model's own plan: a fused [q | k | v] projection needs the packed style (each rank
# keeps its slice of q, of k and of v); `heads` is divided per rank by smp.
USER_PLAN = {
    "embed": "embedding_rowwise",
    "layers.*.attn_in": "packed_qkv_colwise",
    "layers.*.attn_out": "rowwise",
    "layers.*.up": "colwise",
    "layers.*.down": "rowwise",
    "head": "colwise_gather_output",
}


def _plan(kind: str) -> dict | None:
    """The user model needs its plan passed; the HF models bring their own."""
    return USER_PLAN if kind == "user" else None


def build(kind: str) -> nn.Module:
    """Tiny models (hidden 32-64, 2 layers, dropout 0 so that runs are deterministic)."""
    if kind == "llama":  # its own shipped plan; GQA 4 heads / 2 kv heads; rotary
        return tiny_llama(vocab_size=VOCAB)
    if kind == "llama8":  # 8 heads / 4 kv heads: room for TP=4
        return tiny_llama(vocab_size=VOCAB, num_attention_heads=8, num_key_value_heads=4)
    if kind == "qwen2":  # its own shipped plan; q/k/v biases; GQA
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        ))
    if kind == "gpt2":  # smp's table; Conv1D, fused qkv, tied head, learned positions, biases
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        ))
    if kind == "gpt_neox":  # per-head fused qkv, partial rotary, untied embed_out
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        return GPTNeoXForCausalLM(GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
            bos_token_id=0, eos_token_id=0,
        ))
    if kind == "user":
        return TinyTransformer(vocab=VOCAB, dim=32, hidden=64)
    raise ValueError(kind)


def loss_of(model: nn.Module, input_ids: torch.Tensor, hf_loss: bool = True) -> torch.Tensor:
    if isinstance(model, TinyTransformer):
        return causal_lm_loss(model(input_ids), input_ids)
    if hf_loss:
        return model(input_ids=input_ids, labels=input_ids).loss
    return causal_lm_loss(model(input_ids=input_ids).logits, input_ids)


def equivalence(config: dict, kind: str, steps: int = 2, hf_loss: bool = True, corrupt: bool = False) -> dict:
    """TP (x FSDP) run vs the single-process run on the same init and global batch.

    `corrupt` skips the TP all-reduce of one layer's output (its partial sums stay local),
    which the comparison must catch.
    """
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = copy.deepcopy(reference)
        plan = _plan(kind)
        model = smp.transform(model, tp_plan=plan)
        if corrupt:
            _skip_one_all_reduce(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "tp_plan": dict(getattr(model, "_smp_tp_plan", {})),
                  "source": getattr(model, "_smp_tp_plan_source", None), "sharded": 0}
        report["sharded"] = sum(
            1 for p in model.parameters() if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
        )
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
        for _ in range(steps):
            with loss_parallel():
                loss = loss_of(model, local_rows(batch), hf_loss)
                loss.backward()
            ref_loss = loss_of(reference, batch, hf_loss)
            ref_loss.backward()
            report["losses"].append(float(ref_loss))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
            report["grad_diff"] = max(report["grad_diff"], max_grad_diff(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        return report


def _skip_one_all_reduce(model: nn.Module) -> None:
    """Mutation: the first row-wise layer returns its local partial sum as if it were the total."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.endswith(("o_proj", "attn_out", "c_proj", "dense")) and isinstance(weight, DTensor):
            def local_matmul(x: torch.Tensor, _m: nn.Module = module) -> torch.Tensor:
                x = x.to_local() if isinstance(x, DTensor) else x
                return x @ _m.weight.to_local().t()  # no all-reduce of the partial sums

            module._forward_hooks.clear()  # drop the TP input/output layout hooks
            module._forward_pre_hooks.clear()
            module.forward = local_matmul
            return
    raise AssertionError("no row-wise layer found to corrupt")


def plan_of(config: dict, kind: str) -> dict:
    """Which plan smp picked and what it applied where (no training)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build(kind), tp_plan=_plan(kind))
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        return {"source": model._smp_tp_plan_source, "plan": dict(model._smp_tp_plan),
                "tied": head.weight is embed.weight}


def transform_error(config: dict, kind: str, plan: dict | None = None, model_overrides: dict | None = None) -> str:
    """The ConfigError smp.transform raises for this model/config ('' if none)."""
    with smp.session(config):
        torch.manual_seed(0)
        if kind == "llama" and model_overrides:
            model = tiny_llama(vocab_size=VOCAB, **model_overrides)
        else:
            model = build(kind)
        try:
            smp.transform(model, tp_plan=plan)
        except smp.ConfigError as e:
            return str(e)
        return ""


def clip_equivalence(config: dict, kind: str) -> tuple[float, float]:
    """smp.clip_grad_norm_ on the TP x FSDP model vs torch's on the unsharded one."""
    with smp.session(config):
        torch.manual_seed(0)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference), tp_plan=_plan(kind))
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=7)
        loss_of(model, local_rows(batch)).backward()
        loss_of(reference, batch).backward()
        norm = smp.clip_grad_norm_(model, 0.01)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        return abs(float(norm) - float(ref_norm)), max_grad_diff(model, reference)


def batch_rows(config: dict) -> dict:
    """The rows of a global batch this rank trains on, and its mesh coordinates."""
    with smp.session(config):
        batch = torch.arange(8).unsqueeze(1)
        return {"rows": local_rows(batch).flatten().tolist(), "tp_rank": smp.state.tp_rank,
                "tp_size": smp.state.tp_size, "dp_rank": smp.state.dp_rank}


def logits_layout(config: dict, kind: str) -> str:
    """How the LM head hands out its logits: a plain tensor, or (loss parallel) a DTensor."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build(kind), tp_plan=_plan(kind))
        ids = random_batch(2, SEQ, VOCAB, seed=1)
        out = model(ids) if kind == "user" else model(input_ids=ids).logits
        if isinstance(out, DTensor):
            return f"DTensor{tuple(out.placements)} local {tuple(out.to_local().shape)}"
        return f"Tensor {tuple(out.shape)}"


def param_bytes(config: dict, kind: str) -> tuple[int, int]:
    """(this rank's parameter bytes, the full model's parameter bytes)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = build(kind)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        model = smp.transform(model, tp_plan=_plan(kind))
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
        return local, full


def delayed_init_params(config: dict, kind: str) -> float:
    """Largest difference between a model built on meta (delayed init) then TP x FSDP-sharded,
    and the same model built eagerly: parameters must be bitwise equal."""
    with smp.session(dict(config, delayed_param_initialization=True)):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        torch.manual_seed(smp.state.config.random_seed)
        with torch.device("meta"):
            model = build(kind)
        model = smp.transform(model, tp_plan=_plan(kind))
        ref_params = dict(reference.named_parameters())
        return max(float((full_tensor(p.detach()) - ref_params[n]).abs().max()) for n, p in model.named_parameters())


def dropout_run(config: dict) -> tuple[float, float]:
    """GPT-2 with dropout 0.1 under TP (+SP): (training loss, eval loss) on one batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(GPT2LMHeadModel(GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.1,
            embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
        )))
        ids = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.eval()
        with torch.no_grad():
            eval_loss = model(input_ids=ids, labels=ids).loss
        return float(loss), float(eval_loss)


def full_state_dict_diff(config: dict, kind: str) -> tuple[list[str], float]:
    """The TP x FSDP model's full (gathered) state dict vs the unsharded model's: the keys that
    differ, and the largest value difference (checkpoints keep the original layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with smp.session(config):
        torch.manual_seed(0)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference), tp_plan=_plan(kind))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        ref = reference.state_dict()
        keys = sorted(set(full) ^ set(ref))
        diff = max(float((full[k].float() - ref[k].float()).abs().max()) for k in ref if k in full)
        return keys, diff


def backward_collectives(config: dict, kind: str) -> dict[str, int]:
    """Collectives that tensor parallel issues in one backward (FSDP off: world == tp)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build(kind))
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3)
        loss = loss_of(model, batch)
        with CommDebugMode() as comm:
            loss.backward()
        return {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
