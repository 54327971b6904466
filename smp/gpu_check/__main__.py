"""`python -m smp.gpu_check [--out DIR] [--only STEP ...] [--size tiny|1b] [--steps N]`.

The entry point: it picks the device and backend, runs each step (steps take them as plain
values), and writes gpu_check_report.json / .md. Exit code 0 when everything that ran passed
(skips alone are fine), 1 when something ran and failed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import tempfile
import time
import traceback

import torch

from smp.gpu_check import report
from smp.gpu_check.report import FAIL, StepResult

# Step name -> (module, needs CUDA).
STEPS = {
    "device_checks": ("smp.gpu_check.device_checks", False),
    "triton_kernels": ("smp.gpu_check.triton_kernels", True),
    "step_time": ("smp.gpu_check.step_time", True),
    "activation_offloading": ("smp.gpu_check.offloading", True),
    "host_time": ("smp.gpu_check.host_time", True),
    "fp8_training": ("smp.gpu_check.fp8_training", True),
    "cuda_graphs": ("smp.gpu_check.cuda_graphs", False),  # without CUDA: the refusal and compile vs eager
}
TITLES = {
    "device_checks": "World-1 device checks",
    "triton_kernels": "Triton kernels (smp_collectives)",
    "step_time": "Step time and MFU vs plain PyTorch",
    "activation_offloading": "Activation offloading on CUDA",
    "host_time": "Host time per phase and planned vs measured memory",
    "fp8_training": "FP8 training (torchao float8) vs bf16",
    "cuda_graphs": "CUDA graphs of the compiled blocks vs compile and eager",
}
SIZES = ("tiny", "1b")


def environment(device: torch.device) -> dict:
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": None,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        try:
            import pynvml  # optional: the driver version comes from NVML when installed

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - reported as unknown
            env["driver"] = "unknown (pynvml not available)"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m smp.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder for gpu_check_report.json/.md (default: .)")
    parser.add_argument("--only", action="append", choices=list(STEPS), metavar="STEP",
                        help=f"run only this step (repeatable): {', '.join(STEPS)}")
    parser.add_argument("--size", choices=SIZES, default=None,
                        help="model size of the timing steps: 1b (default on CUDA; ~1B-parameter Llama, "
                             "seq 2048) or tiny")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per setting (default 10)")
    return parser.parse_args(argv)


def run_step(name: str, device: torch.device, backend: str, args: argparse.Namespace, work_dir: str) -> StepResult:
    module_name, needs_cuda = STEPS[name]
    title = TITLES[name]
    if args.only and name not in args.only:
        return report.skipped(name, title, "not selected (--only)")
    if needs_cuda and device.type != "cuda":
        return report.skipped(name, title, "no CUDA device")
    module = importlib.import_module(module_name)
    step_dir = os.path.join(work_dir, name)
    os.makedirs(step_dir, exist_ok=True)
    try:
        if name == "device_checks":
            return module.run(device, backend, step_dir)
        return module.run(device, size=args.size, steps=args.steps, out_dir=args.out)
    except Exception as e:  # noqa: BLE001 - a step that crashes is a failed step, the others still run
        traceback.print_exc()
        return StepResult(name, title, FAIL, f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if args.size is None:
        args.size = "1b" if device.type == "cuda" else "tiny"
    os.makedirs(args.out, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="smp_gpu_check_") as work_dir:
        for name in STEPS:
            start = time.perf_counter()
            result = run_step(name, device, backend, args, work_dir)
            print(f"[gpu_check] {name}: {result.line} ({time.perf_counter() - start:.1f} s)", flush=True)
            for f in result.figures:
                if f.status == FAIL:
                    print(f"[gpu_check]   FAIL {f.name}: {f.value} (goal {f.goal}) {f.reason}", flush=True)
            results.append(result)
    env = environment(device)
    env["size"] = args.size
    json_path, md_path = report.write(args.out, env, results)
    print(f"[gpu_check] report: {json_path}, {md_path}", flush=True)
    return report.exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
