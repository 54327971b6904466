"""Step 4 (CUDA only): activation offloading's memory, speed and copy/compute overlap.

Offloading as SMP v2 uses it, on top of full checkpointing: the checkpoints (each block's
input) go to pinned host memory in forward and come back `activation_loading_horizon` blocks
ahead in backward. Against full checkpointing without offloading: peak
torch.cuda.max_memory_allocated and step time at horizons 1, 2, 4 (goal: <= 1.10x at horizon
2); against no checkpointing: the peak. Overlap: a torch.profiler trace of one step at
horizon 2, the fraction of host<->device copy time during which a compute kernel also ran.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import torch

import smp
from smp.gpu_check import workload as wl
from smp.models import resolve_model_config
from smp.gpu_check.report import FAIL, Figure, StepResult, check, skipped

NAME, TITLE = "activation_offloading", "Activation offloading on CUDA"
SLOWDOWN_GOAL, GOAL_HORIZON, WARMUP = 1.10, 2, 2
BASE_CONFIG = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}


def _measure(work: wl.Workload, device: torch.device, config: dict, steps: int, trace_path: str | None = None):
    """(median step seconds, peak bytes allocated in a step) of smp.transform under `config`;
    with `trace_path`, one more step profiled into a Chrome trace there."""
    with smp.session({**BASE_CONFIG, **config}, backend="nccl"):
        torch.manual_seed(0)
        model = smp.transform(wl.build_model(work, device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = wl.batch(work, model.config.vocab_size, device)
        for _ in range(WARMUP):
            wl.train_step(model, opt, ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            wl.train_step(model, opt, ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device)
        # The peak of forward + backward alone: what checkpointing and offloading can lower
        # (AdamW's step, after backward, holds no activations and can set the whole-step peak).
        torch.cuda.reset_peak_memory_stats(device)
        wl.forward_backward(model, ids)
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated(device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if trace_path:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                wl.train_step(model, opt, ids)
                torch.cuda.synchronize()
            prof.export_chrome_trace(trace_path)
        del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(times), peak, backward_peak


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def copy_compute_overlap(trace_path: str) -> tuple[float | None, int]:
    """(fraction of host<->device copy time overlapped by compute kernels, number of copies)
    from a Chrome trace: "gpu_memcpy" events (DtoH / HtoD) against "kernel" events."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]

    def spans(cat: str, names: tuple[str, ...] = ()) -> list[tuple[float, float]]:
        return [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == cat and "dur" in e and (not names or any(n in e.get("name", "") for n in names))]

    copies = spans("gpu_memcpy", ("DtoH", "HtoD"))
    compute = _union(spans("kernel"))
    total = sum(e - s for s, e in copies)
    if not copies or total <= 0:
        return None, 0
    overlapped = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in copies for cs, ce in compute)
    return overlapped / total, len(copies)


def run(device: torch.device, *, size: str, steps: int, out_dir: str) -> StepResult:
    work = wl.WORKLOADS[size]
    config = resolve_model_config(work.shape)
    params_estimate = 12 * config.num_hidden_layers * config.hidden_size**2 + config.vocab_size * config.hidden_size
    shortfall = wl.memory_shortfall(
        wl.bytes_needed(params_estimate, work, 1, config.vocab_size, config.num_hidden_layers, config.hidden_size), device)
    if shortfall:
        return skipped(NAME, TITLE, shortfall)
    trace_path = os.path.join(out_dir, "offloading_trace.json")
    result = StepResult(NAME, TITLE, notes=[
        f"{work.shape}, batch {work.batch} x seq {work.seq}, bf16 params + fp32 reduce, world 1",
        "offloading runs on top of full checkpointing (it moves the checkpoints); baseline: full checkpointing",
        f"trace of one horizon-{GOAL_HORIZON} step: {trace_path}",
    ])
    runs = {"no checkpointing": {}, "full checkpointing": {"activation_checkpointing": "full"}}
    for horizon in (1, 2, 4):
        runs[f"offloading horizon {horizon}"] = {
            "activation_checkpointing": "full", "activation_offloading": True, "activation_loading_horizon": horizon}
    measured = {}
    for label, extra in runs.items():
        trace = trace_path if label == f"offloading horizon {GOAL_HORIZON}" else None
        try:
            measured[label] = _measure(work, device, extra, steps, trace)
        except torch.cuda.OutOfMemoryError as e:
            result.figures.append(Figure(f"{label}: peak memory", None, "GiB", status="skipped",
                                         reason=f"too little GPU memory ({e})".splitlines()[0]))
            gc.collect()
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001 - this run failed; the others still run
            result.figures.append(Figure(f"{label}: run", None, status=FAIL, reason=f"{type(e).__name__}: {e}"))
            continue
        seconds, peak, backward_peak = measured[label]
        result.figures.append(Figure(f"{label}: peak memory", peak / 2**30, "GiB"))
        result.figures.append(Figure(f"{label}: forward + backward peak memory", backward_peak / 2**30, "GiB"))
        result.figures.append(Figure(f"{label}: step time", seconds, "s"))
    base = measured.get("full checkpointing")
    for horizon in (1, 2, 4):
        label = f"offloading horizon {horizon}"
        if base is None or label not in measured:
            continue
        slowdown = measured[label][0] / base[0]
        if horizon == GOAL_HORIZON:
            result.figures.append(check(f"{label}: step time / full checkpointing", slowdown,
                                        slowdown <= SLOWDOWN_GOAL, f"<= {SLOWDOWN_GOAL}"))
        else:
            result.figures.append(Figure(f"{label}: step time / full checkpointing", slowdown))
        result.figures.append(Figure(f"{label}: peak drop vs full checkpointing", 1 - measured[label][1] / base[1],
                                     "fraction"))
        dropped = base[2] - measured[label][2]
        result.figures.append(Figure(f"{label}: forward + backward peak drop vs full checkpointing",
                                     dropped / 2**20, "MiB", reason=f"{1 - measured[label][2] / base[2]:.4f} of it"))
    if base is not None and "no checkpointing" in measured:
        result.figures.append(Figure("full checkpointing: peak drop vs no checkpointing",
                                     1 - base[1] / measured["no checkpointing"][1], "fraction"))
        result.figures.append(Figure("full checkpointing: forward + backward peak drop vs no checkpointing",
                                     1 - base[2] / measured["no checkpointing"][2], "fraction"))
    if os.path.exists(trace_path):
        fraction, copies = copy_compute_overlap(trace_path)
        result.figures.append(Figure("copy/compute overlap (horizon 2)", fraction, "fraction",
                                     reason=f"{copies} DtoH/HtoD copies in the traced step"))
    return result.finish()
