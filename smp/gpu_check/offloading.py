"""Step 4 (CUDA only): activation offloading's memory, speed and copy/compute overlap.

Offloading where it matters: without checkpointing (every activation autograd saves in a block
can move) and on top of full checkpointing (SMP v2's use: only each block's input moves). The
saved tensors go to pinned host memory in forward and come back `activation_loading_horizon`
blocks ahead in backward. Against the same checkpointing without offloading: the forward +
backward peak (torch.cuda.max_memory_allocated) and its drop against the bound, the bytes that
can leave the device at the peak (what the offloader moved, less the `horizon` largest blocks'
share, which may be back at once), and step time at horizons 1, 2, 4 (goal with full
checkpointing: <= 1.10x at horizon 2). Then at a 4x longer sequence (2 x 8192 at the 1b size),
where a block's copies are long enough to hide behind its compute, without checkpointing at
horizon 2: goals, the forward + backward peak drops by >= 80% of its bound, and the step takes
<= 1.10x of no offloading. Overlap: a torch.profiler trace of one step at horizon
2, the fraction of the offloader's own copy time (copies on streams that run no kernel: its
side streams; the loss's and optimizer's copies on the compute stream are left out) during
which a compute kernel also ran.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import torch

import smp
from smp.activations.offloading import offload_stats
from smp.gpu_check import workload as wl
from smp.models import resolve_model_config
from smp.gpu_check.report import FAIL, Figure, StepResult, check, skipped

NAME, TITLE = "activation_offloading", "Activation offloading on CUDA"
SLOWDOWN_GOAL, GOAL_HORIZON, WARMUP = 1.10, 2, 2
DROP_GOAL = 0.80  # of the movable bytes, at the long sequence without checkpointing
LONG_SEQ_FACTOR = 4  # the long sequence: 4x the workload's (2 x 8192 at the 1b size)
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
        stats = offload_stats(model)
        movable = movable_bytes(stats, config.get("activation_loading_horizon", 2)) if stats else 0
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
    return statistics.median(times), peak, backward_peak, movable


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def movable_bytes(stats, horizon: int) -> int:
    """The most the offloader can take off the forward + backward peak: the bytes it moved to
    host, less the `horizon` largest blocks' (back on the device at once when backward starts)."""
    moved = sorted(stats.offloaded_bytes, reverse=True)
    return sum(moved) - sum(moved[:horizon])


def copy_compute_overlap(trace_path: str) -> tuple[float | None, int]:
    """(fraction of the offloader's host<->device copy time overlapped by compute kernels, number
    of its copies) from a Chrome trace: "gpu_memcpy" events (DtoH / HtoD) on streams that run no
    "kernel" event (the offloader's side streams), against the kernel events."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]

    def spans(cat: str, names: tuple[str, ...] = (), streams: set | None = None) -> list[tuple[float, float]]:
        return [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == cat and "dur" in e and (not names or any(n in e.get("name", "") for n in names))
                and (streams is None or _stream(e) in streams)]

    kernel_streams = {_stream(e) for e in events if e.get("cat") == "kernel"}
    copy_streams = {_stream(e) for e in events if e.get("cat") == "gpu_memcpy"} - kernel_streams
    copies = spans("gpu_memcpy", ("DtoH", "HtoD"), copy_streams)
    compute = _union(spans("kernel"))
    total = sum(e - s for s, e in copies)
    if not copies or total <= 0:
        return None, 0
    overlapped = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in copies for cs, ce in compute)
    return overlapped / total, len(copies)


def _stream(event: dict) -> object:
    return event.get("args", {}).get("stream")


def _measure_runs(result: StepResult, work: wl.Workload, device: torch.device, runs: dict, steps: int,
                  trace_path: str | None, prefix: str) -> dict:
    """Each run of `runs` (label -> config) measured on `work`; its figures added to `result`."""
    measured = {}
    for label, extra in runs.items():
        trace = trace_path if label == f"offloading horizon {GOAL_HORIZON}" else None
        try:
            measured[label] = _measure(work, device, extra, steps, trace)
        except torch.cuda.OutOfMemoryError as e:
            result.figures.append(Figure(f"{prefix}{label}: peak memory", None, "GiB", status="skipped",
                                         reason=f"too little GPU memory ({e})".splitlines()[0]))
            gc.collect()
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001 - this run failed; the others still run
            result.figures.append(Figure(f"{prefix}{label}: run", None, status=FAIL, reason=f"{type(e).__name__}: {e}"))
            continue
        seconds, peak, backward_peak, _ = measured[label]
        result.figures.append(Figure(f"{prefix}{label}: peak memory", peak / 2**30, "GiB"))
        result.figures.append(Figure(f"{prefix}{label}: forward + backward peak memory", backward_peak / 2**30, "GiB"))
        result.figures.append(Figure(f"{prefix}{label}: step time", seconds, "s"))
    return measured


def _compare(result: StepResult, measured: dict, comparisons: list[tuple[str, str]], prefix: str,
             judged_slowdown: str | None = None, judged_drop: str | None = None) -> None:
    """Step time and forward + backward peak drop of each (offloaded, base) pair; the runs named
    `judged_*` are held to SLOWDOWN_GOAL and DROP_GOAL, the others reported."""
    for label, base_label in comparisons:
        base = measured.get(base_label)
        if base is None or label not in measured:
            continue
        seconds, _, backward_peak, movable = measured[label]
        slowdown = seconds / base[0]
        name = f"{prefix}{label}: step time / {base_label}"
        if label == judged_slowdown:
            result.figures.append(check(name, slowdown, slowdown <= SLOWDOWN_GOAL, f"<= {SLOWDOWN_GOAL}"))
        else:
            result.figures.append(Figure(name, slowdown))
        dropped = base[2] - backward_peak
        name = f"{prefix}{label}: forward + backward peak drop vs {base_label}"
        if label == judged_drop and movable:
            result.figures.append(check(f"{name}, of its bound", dropped / movable, dropped / movable >= DROP_GOAL,
                                        f">= {DROP_GOAL}", reason=f"{dropped / 2**20:.0f} of {movable / 2**20:.0f} MiB"))
        else:
            result.figures.append(Figure(
                name, dropped / 2**20, "MiB",
                reason=f"bound {movable / 2**20:.0f} MiB" + (f" ({dropped / movable:.2f} of it)" if movable else "")))


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
        "offloading with checkpointing none (every saved activation can move) and full (block inputs move); "
        "each against the same checkpointing without offloading",
        "bound: bytes the offloader moved, less the horizon largest blocks' (back at once when backward starts)",
        f"trace of one horizon-{GOAL_HORIZON} step with full checkpointing: {trace_path}",
    ])
    offload = {"activation_offloading": True}
    no_ckpt_offload = f"offloading horizon {GOAL_HORIZON}, no checkpointing"
    runs = {"no checkpointing": {}, "full checkpointing": {"activation_checkpointing": "full"},
            no_ckpt_offload: {**offload, "activation_loading_horizon": GOAL_HORIZON}}
    for horizon in (1, 2, 4):
        runs[f"offloading horizon {horizon}"] = {
            "activation_checkpointing": "full", **offload, "activation_loading_horizon": horizon}
    measured = _measure_runs(result, work, device, runs, steps, trace_path, prefix="")
    comparisons = [(f"offloading horizon {h}", "full checkpointing") for h in (1, 2, 4)]
    comparisons.append((no_ckpt_offload, "no checkpointing"))
    _compare(result, measured, comparisons, prefix="", judged_slowdown=f"offloading horizon {GOAL_HORIZON}")
    # The long sequence, where the copies are large enough to hide behind the compute: the
    # offloader's goals without checkpointing (every saved activation can move).
    long = wl.Workload(work.shape, batch=work.batch, seq=LONG_SEQ_FACTOR * work.seq)
    prefix = f"seq {long.seq}: "
    result.notes.append(f"then batch {long.batch} x seq {long.seq}: no checkpointing, with and without offloading "
                        f"at horizon {GOAL_HORIZON}")
    long_runs = {"no checkpointing": runs["no checkpointing"], no_ckpt_offload: runs[no_ckpt_offload]}
    long_measured = _measure_runs(result, long, device, long_runs, steps, None, prefix=prefix)
    _compare(result, long_measured, [(no_ckpt_offload, "no checkpointing")], prefix=prefix,
             judged_slowdown=no_ckpt_offload, judged_drop=no_ckpt_offload)
    if "full checkpointing" in measured and "no checkpointing" in measured:
        full, none = measured["full checkpointing"], measured["no checkpointing"]
        result.figures.append(Figure("full checkpointing: forward + backward peak drop vs no checkpointing",
                                     1 - full[2] / none[2], "fraction"))
    if os.path.exists(trace_path):
        fraction, copies = copy_compute_overlap(trace_path)
        result.figures.append(Figure("copy/compute overlap of the offloader's copies (horizon 2)", fraction, "fraction",
                                     reason=f"{copies} DtoH/HtoD copies on the offloader's streams in the traced step"))
    return result.finish()
