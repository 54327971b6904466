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
