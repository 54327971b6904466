"""How long `smp plan` takes for an 8B Llama at 1024 ranks (target: under 10 s), side by side
for a few configs, in one run. Writes bench/results/plan.json.

    .venv/bin/python bench/bench_plan.py            # in-process plans + the full `smp plan` command

Wall time on this shared 2-core machine depends on the other processes running; the CPU time
of this process (user + sys) is reported beside it, and the load average with both.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {
    "full_shard": {},
    "hsdp_8": {"hybrid_shard_degree": 8},
    "tp8_fsdp": {"tensor_parallel_degree": 8},
    "full_shard_ac_full": {"activation_checkpointing": "full"},
}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    t0, c0 = time.perf_counter(), _cpu()
    from smp.planning import GiB, plan

    import transformers  # noqa: F401  (imported by the first plan anyway; timed apart here)

    imports = {"wall_s": time.perf_counter() - t0, "cpu_s": _cpu() - c0}
    rows = {}
    for name, config in CONFIGS.items():
        t, c = time.perf_counter(), _cpu()
        try:
            p = plan(config, "llama-8b", 1024, seq_len=4096, micro_batch=1)
        except Exception as e:  # a feature not in this build: record it, keep going
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        rows[name] = {
            "wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(_cpu() - c, 2), "mesh": p.mesh,
            "device_gib": round(p.device_bytes / GiB, 3), "params_gib": round(p.param_bytes / GiB, 4),
            "optimizer_gib": round(p.optimizer_bytes / GiB, 4), "activations_gib": round(p.activation_bytes / GiB, 3),
            "comm_gib_per_step": round(p.comm_bytes["total"] / GiB, 3),
        }
        print(f"{name:<20} {rows[name]}", flush=True)

    # The whole command a user types, process start-up and imports included.
    cmd = [sys.executable, "-m", "smp.cli", "plan", "--model", "llama-8b", "--world-size", "1024", "--seq-len", "4096"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    children = os.times()
    command = {"argv": "smp plan --model llama-8b --world-size 1024 --seq-len 4096", "rc": proc.returncode,
               "wall_s": round(time.perf_counter() - t, 2),
               "cpu_s": round(children.children_user + children.children_system, 2)}
    print(f"command              {command}")
    result = {
        "benchmark": "smp plan, llama-8b shape, world 1024, seq 4096, micro-batch 1",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}",
        "imports": {k: round(v, 2) for k, v in imports.items()},
        "plans": rows,
        "command": command,
    }
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "plan.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
