"""The metrics formulas (FLOPs per token by hand and by torch's FLOP counter), MFU, writers."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from smp import metrics
from smp.testing.models import tiny_llama


def test_flops_per_token_hand_count():
    # hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 kv heads, vocab 256.
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate/up/down
    matmul = 2 * per_layer + 64 * 256  # + LM head; the embedding is a lookup, not counted
    assert matmul == 90112
    with torch.device("meta"):
        f = metrics.model_flops(tiny_llama())
    assert f == metrics.ModelFlops(matmul_params=90112, layers=2, attention_width=64)
    assert f.per_token(16) == 6 * 90112 + 12 * 2 * 64 * 16 == 565248


def test_flops_formula_equals_torch_flop_counter():
    """6N + 12 L H D T equals what torch counts for one forward + backward (eager attention:
    plain matmuls, which the counter sees)."""
    torch.manual_seed(0)
    model = tiny_llama(attn_implementation="eager")
    batch, seq = 2, 16
    ids = torch.randint(0, 256, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    per_token = counter.get_total_flops() / (batch * seq)
    assert per_token == metrics.model_flops(model).per_token(seq)
    # And the formula is not vacuous: a wrong attention length is off.
    assert per_token != metrics.model_flops(model).per_token(2 * seq)


def test_tied_head_counts_once():
    with torch.device("meta"):
        tied = tiny_llama(tie_word_embeddings=True)
        untied = tiny_llama(tie_word_embeddings=False)
    assert metrics.count_matmul_params(tied) == metrics.count_matmul_params(untied) == 90112


# count_matmul_params per family against a hand count from the config: L layers of width h,
# q/k/v/o projections, MLP, the LM head (V x h, tied or not); embedding lookups excluded.
H, L, V, HEADS, KV_HEADS, INTER = 64, 2, 200, 4, 2, 96
ATTN = 2 * H * H + 2 * H * KV_HEADS * (H // HEADS)  # q, o: h x h; k, v: h x kv_heads x head_dim
E, TOP_K = 4, 2  # MoE: experts, experts per token


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=V,
                                        tie_word_embeddings=tie))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=V))


def _gpt2(**kwargs):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=H, n_layer=L, n_head=HEADS, vocab_size=V, n_positions=64,
                                      bos_token_id=0, eos_token_id=0, **kwargs))


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                                            num_attention_heads=HEADS, vocab_size=V, bos_token_id=0,
                                            eos_token_id=0, tie_word_embeddings=False))


def _plain():
    from smp.testing.models import TinyTransformer

    return TinyTransformer(vocab=V, dim=H, hidden=INTER, layers=L)


def _mixtral(**kwargs):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                                            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                            vocab_size=V, num_local_experts=E, num_experts_per_tok=TOP_K, **kwargs))


def _qwen2_moe(**kwargs):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(hidden_size=H, intermediate_size=INTER, moe_intermediate_size=48,
                                              shared_expert_intermediate_size=80, num_hidden_layers=L,
                                              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                              vocab_size=V, num_experts=E, num_experts_per_tok=TOP_K, **kwargs))


HAND_COUNTS = {
    # gate/up/down 3 x h x I per layer.
    "llama-tied": (lambda: _llama(True), L * (ATTN + 3 * H * INTER) + V * H),
    "llama-untied": (lambda: _llama(False), L * (ATTN + 3 * H * INTER) + V * H),
    "qwen2": (_qwen2, L * (ATTN + 3 * H * INTER) + V * H),  # q/k/v biases are not matmul weights
    # Conv1D c_attn (h x 3h), c_proj (h x h), c_fc (h x 4h), mlp c_proj (4h x h); tied head.
    # (Counting nn.Linear only finds the head: V x h, 1/9 of this.)
    "gpt2": (_gpt2, L * 12 * H * H + V * H),
    # Fused query_key_value (h x 3h), dense (h x h), h x I up and down; untied embed_out.
    "gpt_neox": (_gpt_neox, L * (4 * H * H + 2 * H * INTER) + V * H),
    # attn_in (h x 3h), attn_out (h x h), up / down (h x I); untied head.
    "plain": (_plain, L * (4 * H * H + 2 * H * INTER) + V * H),
    # Router (E x h) and top_k of E experts of gate_up (2I x h) + down (h x I).
    "mixtral": (_mixtral, L * (ATTN + E * H + TOP_K * 3 * H * INTER) + V * H),
    # Plus a shared expert (3 x h x 80, always on) and its 1 x h gate; experts of width 48.
    "qwen2_moe": (_qwen2_moe, L * (ATTN + E * H + TOP_K * 3 * H * 48 + 3 * H * 80 + H) + V * H),
}


@pytest.mark.parametrize("family", list(HAND_COUNTS))
def test_matmul_params_hand_count_per_family(family):
    build, expected = HAND_COUNTS[family]
    with torch.device("meta"):
        model = build()
    assert metrics.count_matmul_params(model) == expected
    # Not vacuous: every parameter counted once would be a different number.
    assert sum(p.numel() for p in model.parameters()) != expected


@pytest.mark.parametrize("family", ["gpt2", "mixtral", "qwen2_moe"])
def test_flops_formula_equals_torch_flop_counter_per_family(family):
    """6N + 12 L H D T against torch's FLOP counter for a Conv1D model and two MoE models:
    each token runs through exactly top_k experts, so the count does not depend on routing.
    Eager attention and eager experts: plain matmuls, which the counter sees."""
    build = {"gpt2": _gpt2, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe}[family]
    torch.manual_seed(0)
    kwargs = {"attn_implementation": "eager"} | ({} if family == "gpt2" else {"experts_implementation": "eager"})
    model = build(**kwargs)
    batch, seq = 2, 16
    ids = torch.randint(0, V, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() / (batch * seq) == metrics.model_flops(model).per_token(seq)


def test_model_flops_needs_shape_for_plain_models():
    with pytest.raises(ValueError, match="layers="):
        metrics.model_flops(torch.nn.Linear(4, 4))
    f = metrics.model_flops(torch.nn.Linear(4, 8, bias=False), layers=1, heads=2, head_dim=2)
    assert f.matmul_params == 32 and f.attention_width == 4


@pytest.mark.parametrize(
    "name,peak",
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
     ("NVIDIA A100-SXM4-80GB", 312e12), ("cpu", None), ("NVIDIA GeForce GTX 1080", None), (None, None)],
)
def test_peak_flops_table(name, peak):
    assert metrics.peak_flops(name) == peak


def test_throughput_and_mfu():
    meter = metrics.ThroughputMeter(flops_per_token=1e9, world_size=2, peak=1e12)
    m = meter.step(tokens_global=1000, seconds=2.0)
    assert m["tokens_per_s"] == 500 and m["tokens_per_s_per_device"] == 250
    assert m["tflops_per_device"] == pytest.approx(0.25)
    assert m["mfu"] == pytest.approx(0.25)
    assert metrics.ThroughputMeter(1e9, 2, None).step(1000, 2.0)["mfu"] is None  # blank, not guessed


def test_peak_memory_on_cpu():
    mem = metrics.peak_memory_bytes("cpu")
    assert list(mem) == ["peak_rss"] and mem["peak_rss"] > 10 * 2**20  # python + torch alone exceed 10 MiB
    assert metrics.gather_per_rank(3.0) == [3.0]


def test_writer_jsonl_and_plot(tmp_path):
    w = metrics.MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 4):
        w.write(step, {"loss": 4.0 - step, "tokens_per_s_per_device": 100.0 * step, "mfu": None,
                       "eval_loss": 3.5 if step == 3 else None, "grad_norm": torch.tensor(1.5)})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["mfu"] is None and "null" in lines[0]
    assert records[2]["grad_norm"] == 1.5
    assert metrics.read_jsonl(tmp_path / "metrics.jsonl") == records
    off = metrics.MetricsWriter(tmp_path / "off", enabled=False)
    off.write(1, {"loss": 1.0})
    assert not (tmp_path / "off").exists()
    pytest.importorskip("matplotlib")
    png = metrics.plot(records, tmp_path / "m.png")
    assert png and (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_writer_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = metrics.MetricsWriter(tmp_path)
    assert w.tensorboard_enabled
    for step in range(1, 4):
        w.write(step, {"loss": 4.0 - step, "mfu": None, "lr": 1e-3})
    w.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "mfu" not in events.Tags()["scalars"]  # unknown values are left out, not written as 0
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]


def test_writer_keeps_running_on_nonfinite_values(tmp_path):
    w = metrics.MetricsWriter(tmp_path, tensorboard=False)
    w.write(1, {"loss": float("nan"), "grad_norm": torch.tensor(float("inf")), "lr": 1e-3})
    w.close()
    record = metrics.read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert record["loss"] is None and record["grad_norm"] is None and record["lr"] == 1e-3
