"""Step 5 (CUDA only): host time per phase, smp vs plain, and smp plan's memory estimate vs the peak.

The world-1 step on a fast GPU is host-bound when the framework adds Python work per unit
(docs/sharding.md, unit layout). Per phase (forward, backward, optimizer) this step times the
host thread (`time.thread_time`: CPU seconds of the Python thread that launches the kernels) of
smp (bf16 params + fp32 reduce, world 1: no FSDP units) and of the plain loop (fp32 parameters
under bf16 autocast), in alternating rounds; goal: smp / plain <= 1.05 for the whole step. Then
activation checkpointing none / full / selective through smp, eager (host time per phase and
step time: selective's eager cost is torch's two Python dispatch modes per recomputed op).
Last, `smp plan`'s device-memory estimate against the measured peak of a step, at the size's
workload and at 8 x 4096 tokens with full checkpointing.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

import smp
from smp.gpu_check import workload as wl
from smp.gpu_check.report import FAIL, Figure, StepResult, check, skipped

NAME, TITLE = "host_time", "Host time per phase and planned vs measured memory"
HOST_GOAL, WARMUP, ROUND = 1.05, 3, 2
BASE_CONFIG = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
PHASES = ("forward", "backward", "optimizer", "step")
LONG = wl.Workload("llama-1b", batch=8, seq=4096)  # 8 x 4096 tokens a step


def phase_times(model, optimizer, ids, steps: int) -> dict[str, list[float]]:
    """Host-thread seconds per phase of `steps` steps, plus each step's wall time ("wall")."""
    times: dict[str, list[float]] = {k: [] for k in (*PHASES, "wall")}
    for _ in range(steps):
        torch.cuda.synchronize()
        wall, t0 = time.perf_counter(), time.thread_time()
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.thread_time()
        torch.cuda.synchronize()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, time.perf_counter() - wall)):
            times[key].append(value)
    return times


def _alternate(runs: dict, steps: int) -> dict[str, dict[str, float]]:
    """Median per phase of each (model, optimizer, ids) in `runs`, in alternating rounds."""
    for model, opt, ids in runs.values():
        phase_times(model, opt, ids, WARMUP)
    collected = {name: {k: [] for k in (*PHASES, "wall")} for name in runs}
    for _ in range(max(1, steps // ROUND)):
        for name, (model, opt, ids) in runs.items():
            for key, values in phase_times(model, opt, ids, ROUND).items():
                collected[name][key] += values
    return {name: {k: statistics.median(v) for k, v in times.items()} for name, times in collected.items()}


def _peak(model, optimizer, ids) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    phase_times(model, optimizer, ids, 1)
    return torch.cuda.max_memory_allocated()


def planned_vs_peak(work: wl.Workload, device: torch.device, config: dict) -> tuple[float, float]:
    """(smp plan's device bytes, measured peak bytes) of one step of `work` under `config`."""
    from smp.planning.report import plan

    planned = plan(config, work.shape, 1, seq_len=work.seq, micro_batch=work.batch).device_bytes
    gc.collect()
    torch.cuda.empty_cache()
    with smp.session(config, backend="nccl"):
        torch.manual_seed(0)
        model = smp.transform(wl.build_model(work, device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = wl.batch(work, model.config.vocab_size, device)
        phase_times(model, opt, ids, 1)  # AdamW state exists from here
        peak = _peak(model, opt, ids)
        del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return planned, peak


def _phase_figures(result: StepResult, label: str, got: dict[str, float], base: dict[str, float], base_name: str) -> None:
    for phase in PHASES:
        result.figures.append(Figure(f"{label}: host {phase}", got[phase] * 1e3, "ms",
                                     reason=f"{base_name} {base[phase] * 1e3:.2f} ms ({got[phase] / base[phase]:.2f}x)"))


def run(device: torch.device, *, size: str, steps: int, out_dir: str) -> StepResult:
    work = wl.WORKLOADS[size]
    plain, params, shortfall = wl.build_if_it_fits(work, device)
    if shortfall:
        return skipped(NAME, TITLE, shortfall)
    result = StepResult(NAME, TITLE, notes=[
        f"{work.shape}: {params / 1e9:.2f}B parameters, batch {work.batch} x seq {work.seq}, bf16 autocast, AdamW",
        "host time: time.thread_time of the launching thread per phase, median of alternating rounds",
    ])
    ids = wl.batch(work, plain.config.vocab_size, device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-5)
    try:
        with smp.session(BASE_CONFIG, backend="nccl"):
            model = smp.transform(copy.deepcopy(plain))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            from smp.sharding.fsdp import describe_layout

            result.notes.append(describe_layout(model) or "no unit layout recorded")
            times = _alternate({"smp": (model, opt, ids), "plain": (plain, plain_opt, ids)}, steps)
            del model, opt
        ratio = times["smp"]["step"] / times["plain"]["step"]
        result.figures.append(check("smp / plain host time per step", ratio, ratio <= HOST_GOAL, f"<= {HOST_GOAL}",
                                    reason=f"smp {times['smp']['step'] * 1e3:.1f} ms, plain "
                                           f"{times['plain']['step'] * 1e3:.1f} ms"))
        result.figures.append(Figure("smp / plain step wall time", times["smp"]["wall"] / times["plain"]["wall"],
                                     reason=f"plain {times['plain']['wall']:.4f} s"))
        _phase_figures(result, "smp", times["smp"], times["plain"], "plain")
    except Exception as e:  # noqa: BLE001 - the other parts still run
        result.figures.append(Figure("smp vs plain host time", None, status=FAIL, reason=f"{type(e).__name__}: {e}"))
    del plain_opt
    gc.collect()
    torch.cuda.empty_cache()
    # Checkpointing modes, eager, through smp: one model at a time against `none`.
    runs = {}
    for mode in ("none", "full", "selective"):
        with smp.session({**BASE_CONFIG, "activation_checkpointing": mode}, backend="nccl"):
            model = smp.transform(copy.deepcopy(plain))
            runs[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5), ids)
    try:
        modes = _alternate(runs, steps)
        for mode in ("full", "selective"):
            result.figures.append(Figure(f"checkpointing {mode} / none step wall time",
                                         modes[mode]["wall"] / modes["none"]["wall"],
                                         reason=f"host {modes[mode]['step'] / modes['none']['step']:.2f}x of none"))
            _phase_figures(result, f"checkpointing {mode}", modes[mode], modes["none"], "none")
    except torch.cuda.OutOfMemoryError as e:
        result.figures.append(Figure("checkpointing modes", None, status="skipped", reason=str(e).splitlines()[0]))
    del runs, plain
    gc.collect()
    torch.cuda.empty_cache()
    # smp plan's estimate vs the measured peak.
    for label, work_here, extra in ((f"{work.batch} x {work.seq}", work, {}),
                                    (f"{LONG.batch} x {LONG.seq}, full checkpointing", LONG,
                                     {"activation_checkpointing": "full"})):
        if size != "1b" and work_here is LONG:
            continue  # the long workload is the 1.2B shape's
        try:
            planned, peak = planned_vs_peak(work_here, device, {**BASE_CONFIG, **extra})
            result.figures.append(Figure(f"smp plan / measured peak ({label})", planned / peak,
                                         reason=f"plan {planned / 2**30:.2f} GiB, measured {peak / 2**30:.2f} GiB"))
        except torch.cuda.OutOfMemoryError as e:
            result.figures.append(Figure(f"smp plan / measured peak ({label})", None, status="skipped",
                                         reason=f"too little GPU memory ({e})".splitlines()[0]))
        gc.collect()
        torch.cuda.empty_cache()
    return result.finish()
