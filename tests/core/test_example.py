"""The fine-tuning example end to end: 2 ranks through `smp run` (or the torchrun command it
execs), loss decreases, checkpoint + exact resume + safetensors export; and its error messages."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from tests import REPO_ROOT

ROOT = str(REPO_ROOT)
SCRIPT = os.path.join(ROOT, "examples", "finetune_causal_lm.py")


def _example():
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(*args: str, smp_run: bool = False) -> subprocess.CompletedProcess:
    """The example on 2 ranks: through `smp run` (the README's command) with `smp_run`, else
    through the torchrun command line `smp run` execs (`torchrun_argv`, the same argv; it saves
    the ~3 s the `smp` process spends importing smp before its exec)."""
    from smp.cli import torchrun_argv

    script = [SCRIPT, "--no-progress", *args]
    cmd = [sys.executable, "-m", "smp.cli", "run", "-n", "2", *script] if smp_run else torchrun_argv(2, script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _records(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_finetune_two_ranks_resume_and_export(tmp_path, monkeypatch):
    first, resumed = tmp_path / "run", tmp_path / "resumed"
    _launch("--output-dir", str(first), "--steps", "8", "--checkpoint-every", "4", "--eval-every", "4", smp_run=True)
    records = _records(first)
    assert [r["step"] for r in records] == list(range(1, 9))
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses  # learns the corpus, not noise
    evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
    assert len(evals) == 2 and evals[1] < evals[0]
    last = records[-1]
    assert last["mfu"] is None  # CPU: no known peak, blank not guessed
    assert len(last["peak_rss_bytes_per_rank"]) == 2 and min(last["peak_rss_bytes_per_rank"]) > 0
    assert last["tokens_per_s"] > 0 and last["tflops_per_device"] > 0 and last["grad_sync_bytes_per_rank"] > 0
    assert (first / "metrics.png").exists() or importlib.util.find_spec("matplotlib") is None
    assert sorted(os.listdir(first / "checkpoints")) == ["step_4", "step_8"]

    # Resume from step 4 in a fresh run: steps 5..8 repeat the uninterrupted run's losses.
    _launch("--output-dir", str(resumed), "--steps", "8", "--resume", str(first / "checkpoints" / "step_4"),
            "--checkpoint-every", "0", "--eval-every", "0", "--no-export")
    again = _records(resumed)
    assert [r["step"] for r in again] == [5, 6, 7, 8]
    for a, b in zip(again, records[4:]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), (a["step"], a["loss"], b["loss"])

    # The export is a Hugging Face folder holding the trained weights.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(first / "hf")
    example = _example()
    rows = example.packed_rows([example.builtin_corpus()], example.ByteTokenizer(), 64)
    held_out = rows[-max(8, rows.shape[0] // 20):][:16]  # what the example evaluates on (2 batches of 8)
    with torch.no_grad():
        trained = float(model(input_ids=held_out, labels=held_out).loss)
    assert trained == pytest.approx(evals[-1], abs=2e-3)  # the exported model scores the run's eval loss
    assert trained < losses[0] - 0.5

    # Fine-tune from that local folder: its weights are loaded (load_hf), not a random init. In
    # this process (a third launch cost ~15 s): the example's --model path is the same at any
    # world size, and load_hf into a model sharded over 2 ranks is proven exact by
    # tests/checkpointing/test_checkpointing.py::test_load_hf_into_sharded_model.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SMP_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    tuned = tmp_path / "tuned"
    example.main(["--model", str(first / "hf"), "--output-dir", str(tuned), "--steps", "2", "--lr", "1e-4",
                  "--checkpoint-every", "0", "--eval-every", "0", "--no-export", "--no-progress"])
    assert _records(tuned)[0]["loss"] < losses[0] - 0.5  # starts trained, not from random init


PIPELINE_CONFIG = os.path.join(ROOT, "examples", "configs", "pipeline.yaml")
PIPELINE_COMMON = ["--steps", "4", "--eval-every", "2", "--no-progress"]


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory):
    """One pipelined run at world 2 (checkpoints at steps 2 and 4, evals at 2 and 4, the export)
    for the tests below: each launch costs ~15 s of start-up on 2 cores."""
    pp = tmp_path_factory.mktemp("example") / "pp"
    proc = _launch("--config", PIPELINE_CONFIG, "--output-dir", str(pp), "--checkpoint-every", "2", *PIPELINE_COMMON)
    return pp, proc.stdout


def test_pipeline_config_trains_like_one_process(pipelined_run, tmp_path, monkeypatch):
    """examples/configs/pipeline.yaml (2 stages, 1F1B, 4 micro-batches) at world 2, nothing else
    changed: per-step loss, gradient norm and eval loss equal the one-process run's (1e-5); its
    checkpoint resumes in one process (no pipeline) to the uninterrupted losses; its export
    loads with from_pretrained and scores the run's eval loss."""
    (pp, stdout), single, resumed = pipelined_run, tmp_path / "single", tmp_path / "resumed"
    assert "pp 2 x" in stdout, stdout[-2000:]
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SMP_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    example = _example()
    example.main(["--output-dir", str(single), "--checkpoint-every", "0", "--no-export", *PIPELINE_COMMON])
    records, expected = _records(pp), _records(single)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "eval_loss"):
        got, want = [r.get(key) for r in records], [r.get(key) for r in expected]
        assert [g is None for g in got] == [w is None for w in want], key
        assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], abs=1e-5), key

    example.main(["--output-dir", str(resumed), "--resume", str(pp / "checkpoints" / "step_2"),
                  "--checkpoint-every", "0", "--no-export", *PIPELINE_COMMON])
    assert [r["loss"] for r in _records(resumed)] == pytest.approx([r["loss"] for r in records[2:]], abs=1e-5)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pp / "hf")
    rows = example.packed_rows([example.builtin_corpus()], example.ByteTokenizer(), 64)
    held_out = rows[-max(8, rows.shape[0] // 20):][:16]  # what the example evaluates on (2 batches of 8)
    with torch.no_grad():
        assert float(model(input_ids=held_out, labels=held_out).loss) == pytest.approx(records[-1]["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_pipeline_resume_at_pp2(pipelined_run, tmp_path):
    """The pipelined run's checkpoint loaded back into 2 stages: the resumed steps repeat the
    uninterrupted run's losses and its last evaluation."""
    first, _ = pipelined_run
    resumed = tmp_path / "resumed"
    _launch("--config", PIPELINE_CONFIG, "--output-dir", str(resumed), "--resume", str(first / "checkpoints" / "step_2"),
            "--checkpoint-every", "0", "--no-export", *PIPELINE_COMMON)
    again, records = _records(resumed), _records(first)[2:]
    assert [r["step"] for r in again] == [3, 4]
    for key in ("loss", "eval_loss"):
        assert [r.get(key) for r in again] == pytest.approx([r.get(key) for r in records], abs=1e-5), key


def test_errors_are_clear(tmp_path):
    ex = _example()
    with pytest.raises(SystemExit, match="--data .*no such file"):
        ex.check_args(ex.parse_args(["--data", str(tmp_path / "missing.jsonl")]), 2)
    (tmp_path / "model").mkdir()
    with pytest.raises(SystemExit, match="has no config.json"):
        ex.check_args(ex.parse_args(["--model", str(tmp_path / "model")]), 2)
    with pytest.raises(SystemExit, match="--global-batch 7 is not divisible by the data-parallel size 2"):
        ex.check_args(ex.parse_args(["--global-batch", "7"]), 2)
    with pytest.raises(SystemExit, match="not divisible by --grad-accum 3"):
        ex.check_args(ex.parse_args(["--global-batch", "8", "--grad-accum", "3"]), 2)
    with pytest.raises(SystemExit, match="hybrid_shard_degree=3"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text("hybrid_shard_degree: 3\n")
        ex.check_args(ex.parse_args(["--config", str(cfg)]), 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(SystemExit, match="line 2 has no 'text' field"):
        ex.read_texts(str(bad), "text")
    # smp.step accumulates under pipeline parallelism too (tests/training/test_step.py::test_accumulation)
    assert ex.check_args(ex.parse_args(["--config", PIPELINE_CONFIG, "--grad-accum", "2"]), 2).pp == 2
    assert ex.check_args(ex.parse_args(["--config", PIPELINE_CONFIG]), 2).pp == 2
    assert ex.check_args(ex.parse_args([]), 2).dp == 2


def test_data_packing_and_schedule(tmp_path):
    ex = _example()
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "abcdef"}\n{"text": "ghij"}\n')
    rows = ex.packed_rows(ex.read_texts(str(data), "text"), ex.ByteTokenizer(), 4)
    assert rows.tolist() == [list(b"abcd"), list(b"efgh")]  # packed across documents, tail dropped
    assert len(ex.builtin_corpus()) > 100_000  # enough text for the default run, offline
    lrs = [ex.lr_at(s, 100, 1.0, warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1, abs=0.01)
    assert ex.step_rows(3, 100, 8, 1).tolist() == ex.step_rows(3, 100, 8, 1).tolist()
    assert ex.step_rows(3, 100, 8, 1).tolist() != ex.step_rows(4, 100, 8, 1).tolist()


def test_grad_accumulation_matches_one_big_batch(tmp_path, monkeypatch):
    """--grad-accum 2 (two micro-batches, one sync) trains exactly like the whole batch at once
    (one process; the 2-rank run above covers the distributed path)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SMP_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    ex = _example()
    common = ["--steps", "3", "--checkpoint-every", "0", "--eval-every", "0", "--no-export", "--no-progress"]
    runs = {}
    for accum in (1, 2):
        out = tmp_path / f"accum{accum}"
        ex.main([*common, "--grad-accum", str(accum), "--output-dir", str(out)])
        runs[accum] = [(r["loss"], r["grad_norm"]) for r in _records(out)]
    # The gradient norm (before clipping) catches a mis-scaled accumulation that Adam would hide.
    assert [x for pair in runs[1] for x in pair] == pytest.approx([x for pair in runs[2] for x in pair], abs=1e-5)
    assert runs[1][-1][0] < runs[1][0][0]
