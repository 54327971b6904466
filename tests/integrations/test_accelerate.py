"""accelerate loops on smp (docs/accelerate.md): tests/integrations/accelerate_script.py, a plain accelerate
loop, run without smp (the oracle) and with the three smp lines, as users launch it (torchrun
subprocesses, ACCELERATE_USE_CPU=1 on CPU).

- FSDP 2 equals the same script without smp under DDP at world 2 (every step's loss, the
  clipped global grad norm and the learning rate; eval loss), negative control: the norm of the
  gradients one rank holds is not it.
- TP 2 and PP 2 equal one process (same), eval over the data-parallel ranks counts each row
  once; negative controls: gathered over every process the rows come twice; one pipeline
  stage's gradient norm is not the model's.
- A resume from save_state at step 3 repeats the uninterrupted run's steps 4..6.
- save_pretrained into the output_dir (beside step_N folders) loads in from_pretrained with no
  missing keys and scores the trained model's probe loss.
- Refusals: the model left out of prepare; load_state of a folder saved without smp; an
  Accelerator that runs as one process in a world of two; MASTER_ADDR without RANK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tests import REPO_ROOT

ROOT = str(REPO_ROOT)
SCRIPT = os.path.join(ROOT, "tests", "integrations", "accelerate_script.py")
TOL = 1e-5  # float32 sums reordered by sharding / tensor parallelism (measured <= 5e-7)


def _launch(out, *args: str, world: int = 2, smp: dict | None = None, use_cpu: bool = True,
            expect_ok: bool = True) -> subprocess.CompletedProcess:
    from smp.cli import torchrun_argv

    script = [SCRIPT, "--out", str(out), *args] + ([] if smp is None else ["--smp", json.dumps(smp)])
    cmd = torchrun_argv(world, script) if world > 1 else [sys.executable, *script]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "SMP_"))}
    env.update(OMP_NUM_THREADS="1", **({"ACCELERATE_USE_CPU": "1"} if use_cpu else {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    else:
        assert proc.returncode != 0, proc.stdout[-2000:]
    return proc


def _log(out) -> tuple[list[dict], dict]:
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return records[:-1], records[-1]


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOL), (a, b)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12), (a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run once, on first use (a dict of output folders)."""
    root = tmp_path_factory.mktemp("accelerate")
    made: dict = {}
    plans = {
        "ddp2": dict(world=2),
        "fsdp2": dict(world=2, smp={}),
        "one": dict(world=1),
        "tp2": dict(world=2, smp={"tensor_parallel_degree": 2}),
        # The pipelined model(**batch) runs the whole step, so one accumulation step (its loss
        # reaches backward unscaled); its reference is one process at the same setting.
        "pp2": dict(world=2, smp={"pipeline_parallel_degree": 2}, args=("--grad-accum", "1")),
        "one_ga1": dict(world=1, args=("--grad-accum", "1")),
        # One data-parallel rank shuffles as accelerate's one-process loader does (the order is
        # drawn when iteration starts; a resumed epoch draws it again): exact resume needs
        # accelerate's seedable sampler, in one process as under TP.
        "tp2_seedable": dict(world=2, smp={"tensor_parallel_degree": 2}, args=("--seedable-sampler",)),
    }

    def get(name: str):
        if name not in made:
            plan = dict(plans[name])
            _launch(root / name, "--checkpointing-steps", "3", *plan.pop("args", ()), **plan)
            made[name] = root / name
        return made[name]

    return get


@pytest.mark.slow
def test_fsdp2_equals_ddp_without_smp(runs):
    smp_steps, smp_end = _log(runs("fsdp2"))
    ddp_steps, ddp_end = _log(runs("ddp2"))
    assert len(smp_steps) == 6
    _assert_same_steps(smp_steps, ddp_steps)
    assert smp_end["eval_loss"] == pytest.approx(ddp_end["eval_loss"], abs=TOL)
    assert smp_end["eval_rows"] == ddp_end["eval_rows"] == 7
    # Negative control: the norm of the gradients one FSDP rank holds is not the global norm.
    assert all(abs(r["local_grad_norm"] - r["grad_norm"]) > 1e-2 for r in smp_steps)


@pytest.mark.slow
def test_tp2_equals_one_process(runs):
    tp_steps, tp_end = _log(runs("tp2"))
    one_steps, one_end = _log(runs("one"))
    _assert_same_steps(tp_steps, one_steps)
    assert tp_end["eval_rows"] == one_end["eval_rows"] == 7
    assert tp_end["eval_loss"] == pytest.approx(one_end["eval_loss"], abs=TOL)
    # Negative control: gathered over every process, the rows of the two TP ranks count twice.
    assert tp_end["every_process_rows"] == 2 * 7


@pytest.mark.slow
def test_pp2_equals_one_process(runs):
    pp_steps, pp_end = _log(runs("pp2"))
    one_steps, one_end = _log(runs("one_ga1"))
    _assert_same_steps(pp_steps, one_steps)
    assert pp_end["eval_rows"] == one_end["eval_rows"] == 7  # the ragged last eval batch too
    assert pp_end["eval_loss"] == pytest.approx(one_end["eval_loss"], abs=TOL)
    # Negative control: one stage's gradients alone are not the model's norm.
    assert all(abs(r["local_grad_norm"] - r["grad_norm"]) > 1e-2 for r in pp_steps)


@pytest.mark.slow
def test_resume_from_save_state_is_exact(runs, tmp_path):
    first = runs("fsdp2")
    assert sorted(os.listdir(first / "step_3")) == [
        "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin", "smp_model"]
    _launch(tmp_path / "resumed", "--resume-from", str(first / "step_3"), smp={})
    resumed, end = _log(tmp_path / "resumed")
    uninterrupted, first_end = _log(first)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(resumed, uninterrupted[3:]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a, b)
        assert a["lr"] == b["lr"]
    assert end["eval_loss"] == pytest.approx(first_end["eval_loss"], abs=1e-6)


@pytest.mark.slow
def test_tp2_resume_with_seedable_sampler_is_exact(runs, tmp_path):
    first = runs("tp2_seedable")
    proc = _launch(tmp_path / "resumed", "--resume-from", str(first / "step_3"), "--seedable-sampler",
                   smp={"tensor_parallel_degree": 2})
    assert "use_seedable_sampler=True" not in proc.stderr  # nothing to warn about
    resumed, _ = _log(tmp_path / "resumed")
    for a, b in zip(resumed, _log(first)[0][3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "pp2"])
def test_save_pretrained_into_output_dir_loads(runs, layout):
    from transformers import LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(SCRIPT))
    from accelerate_script import rows

    out = runs(layout)
    assert {"step_3", "step_6", "log.jsonl", "config.json"} <= set(os.listdir(out))  # beside the run's files
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    probe = rows(3, 3)
    ids = torch.stack([r["input_ids"] for r in probe])
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert loss == pytest.approx(_log(out)[1]["probe_loss"], abs=TOL)


@pytest.mark.slow
def test_refusals_name_the_fix(runs, tmp_path):
    # The model left out of prepare: save_state would write the optimizer without weights.
    proc = _launch(tmp_path / "no_model", "--skip-model-in-prepare", smp={}, expect_ok=False)
    assert proc.stderr.count("pass the model to accelerator.prepare") >= 2  # every rank
    # A save_state folder written without smp holds model.safetensors, not smp's checkpoint.
    proc = _launch(tmp_path / "from_ddp", "--resume-from", str(runs("ddp2") / "step_3"), smp={}, expect_ok=False)
    assert "smp_model/" in proc.stderr and "load_hf" in proc.stderr
    # accelerate under torchrun on CPU without ACCELERATE_USE_CPU runs every rank as one process.
    proc = _launch(tmp_path / "no_cpu_flag", smp={}, use_cpu=False, expect_ok=False)
    assert proc.stderr.count("ACCELERATE_USE_CPU=1") >= 2 and "Accelerator(cpu=True)" in proc.stderr


def test_master_addr_without_rank_is_refused():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29599", ACCELERATE_USE_CPU="True")
    code = "import smp\ntry:\n    smp.init()\nexcept smp.ConfigError as e:\n    print('REFUSED', e)\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in proc.stdout and "accelerate launch" in proc.stdout and "torchrun" in proc.stdout, proc


def test_export_hf_into_a_folder_with_other_files(tmp_path):
    """One process: export_hf into an output_dir keeps its other files, replaces the model files,
    and loads in from_pretrained; the old argument order of export_hf_folder warns."""
    import smp
    from smp.integrations import export_hf_folder

    sys.path.insert(0, os.path.dirname(SCRIPT))
    from accelerate_script import build_model

    out = tmp_path / "output_dir"
    (out / "step_2").mkdir(parents=True)
    (out / "step_2" / "scheduler.bin").write_bytes(b"x")
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")  # a previous save's shard
    with smp.session({}):
        model = smp.transform(build_model())
        smp.checkpointing.export_hf(out, model)
        with pytest.warns(DeprecationWarning, match="export_hf_folder\\(out_dir, model\\)"):
            export_hf_folder(model, out)
    names = set(os.listdir(out))
    assert {"step_2", "tokenizer.json", "config.json"} <= names
    assert "model-00001-of-00002.safetensors" not in names and ".smp_hf_export" not in names
    assert not {"smp_meta.json", "smp_commit.json"} & names  # the folder is not an smp export
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(out)
    reference = build_model()
    for (name, a), (_, b) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_session_undoes_what_it_changed():
    """smp.init routes Accelerator.prepare through smp and adapts the accelerator; smp.shutdown
    puts back accelerate's method and removes every instance attribute and hook (a subprocess:
    accelerate's state is a process-wide singleton)."""
    code = """
import torch, accelerate, smp
from accelerate import Accelerator
from smp.integrations.accelerate import _OVERRIDES
original = Accelerator.__dict__["prepare"]
accelerator = Accelerator(cpu=True)
with smp.session({}):
    assert Accelerator.__dict__["prepare"] is not original
    model = smp.transform(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert set(_OVERRIDES) - {"gather", "gather_for_metrics", "reduce"} <= set(vars(accelerator))
    assert "save_pretrained" in vars(model) and len(accelerator._save_model_state_pre_hook) == 1
assert Accelerator.__dict__["prepare"] is original
assert not set(_OVERRIDES) & set(vars(accelerator)), set(_OVERRIDES) & set(vars(accelerator))
assert "save_pretrained" not in vars(model)
assert not accelerator._save_model_state_pre_hook and not accelerator._load_model_state_pre_hook
print("RESTORED")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "SMP_", "MASTER_", "RANK"))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "RESTORED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
