"""`python -m smp.gpu_check` on this CPU-only machine: step 1 runs on CPU, the GPU-only steps
report themselves skipped, and a failing check makes the command exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from smp.gpu_check.offloading import copy_compute_overlap
from tests import REPO_ROOT

ROOT = REPO_ROOT
GPU_ONLY = ("triton_kernels", "step_time", "activation_offloading", "host_time", "fp8_training")


def _run(args: list[str], code: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "smp.gpu_check", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _steps(out: Path) -> dict[str, dict]:
    report = json.loads((out / "gpu_check_report.json").read_text())
    return {s["name"]: s for s in report["steps"]}


def test_cpu_run_passes_and_skips_gpu_steps(tmp_path):
    proc = _run(["--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _steps(tmp_path)
    assert list(steps) == ["device_checks", *GPU_ONLY, "cuda_graphs"]  # cuda_graphs: its CPU part runs too
    for name in GPU_ONLY:
        assert steps[name]["line"] == "skipped: no CUDA device"
    device = steps["device_checks"]
    assert device["status"] == "pass"
    names = " ".join(f["name"] for f in device["figures"])
    for what in ("full shard", "hybrid", "checkpointing full", "checkpointing selective", "offloading horizon 1",
                 "resume", "hf export", "delayed init"):
        assert what in names
    assert all(f["status"] == "pass" for f in device["figures"])
    report = json.loads((tmp_path / "gpu_check_report.json").read_text())
    assert report["environment"]["torch"] and report["environment"]["triton"]
    assert "skipped: no CUDA device" in (tmp_path / "gpu_check_report.md").read_text()


def test_cuda_graphs_step_on_cpu_checks_the_refusal_and_compile(tmp_path):
    """Without CUDA the step runs what it can: smp.init refusing the key, compile (aot_eager)
    against eager; the CUDA-graph figures say skipped."""
    proc = _run(["--out", str(tmp_path), "--only", "cuda_graphs"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = _steps(tmp_path)["cuda_graphs"]
    assert step["status"] == "pass", step
    by_status = {f["name"]: f["status"] for f in step["figures"]}
    assert by_status["refused at smp.init without CUDA, naming the key and the fix"] == "pass"
    assert by_status["compile (aot_eager) vs eager, no CUDA graphs: step-1 grad diff"] == "pass"
    assert by_status["cuda graphs vs compile: losses, grads, params"] == "skipped"


# Negative control: smp.transform nudges one weight after transforming, so the transformed model
# no longer computes what the untransformed one does; the command must notice and exit 1.
PERTURBED = """
import sys, torch, smp
from smp.gpu_check.__main__ import main
original = smp.transform
def perturbed(model, **kwargs):
    model = original(model, **kwargs)
    with torch.no_grad():
        next(model.parameters()).mul_(1.01)
    return model
smp.transform = perturbed
sys.exit(main(sys.argv[1:]))
"""


def test_a_failing_check_makes_the_command_fail(tmp_path):
    proc = _run(["--out", str(tmp_path), "--only", "device_checks"], code=PERTURBED)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    steps = _steps(tmp_path)
    device = steps["device_checks"]
    assert device["status"] == "fail"
    failed = [f["name"] for f in device["figures"] if f["status"] == "fail"]
    assert "full shard: loss diff vs untransformed" in failed
    assert steps["step_time"]["line"] == "skipped: not selected (--only)"


def test_overlap_fraction_of_a_trace(tmp_path):
    # Compute kernels (stream 7) cover [0, 15); the offloader's copy (stream 20) runs over [12, 20):
    # 3 of its 8 units overlap. A copy on the compute stream (the loss read back, the optimizer) is
    # not the offloader's and is left out; so is a device-to-device copy.
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "args": {"stream": 7}},
        {"cat": "kernel", "name": "gemm", "ts": 5, "dur": 10, "args": {"stream": 7}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 12, "dur": 8, "args": {"stream": 20}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "ts": 30, "dur": 50, "args": {"stream": 7}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 0, "dur": 8, "args": {"stream": 20}},
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert copy_compute_overlap(str(path)) == (0.375, 1)
