"""Step 3 (CUDA only): step time and MFU through smp.transform vs a plain PyTorch loop.

The same Llama-shaped model and the same user step (bf16 autocast, AdamW) twice: once plain
(fp32 parameters, no smp), once through smp.transform at world 1 (FSDP2 with bf16 parameters
and fp32 reduction). Both stay resident and are timed in alternating rounds, so clock and
thermal drift hit both alike; goal: smp / plain <= 1.02 without checkpointing. `compile: true`
is timed against the plain loop with the same blocks compiled (`module.compile()` per decoder
layer, torchtitan's way), with the same goal. MFU comes from smp.metrics for every setting; the
goal is that smp's best MFU reaches the plain loop's best (eager or compiled): an absolute figure
depends on the shape more than on smp (docs/gpu-check.md).
"""

from __future__ import annotations

import copy
import gc
import statistics

import torch

import smp
from smp import metrics
from smp.gpu_check import workload as wl
from smp.gpu_check.report import FAIL, Figure, StepResult, check, skipped
from smp.sharding.blocks import find_blocks

NAME, TITLE = "step_time", "Step time and MFU vs plain PyTorch"
RATIO_GOAL, MFU_GOAL = 1.02, 0.98  # smp / plain step time; smp's best MFU / plain's best MFU
WARMUP, ROUND = 3, 2  # warm-up steps per model (compile happens here); steps per alternating turn
BASE_CONFIG = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
SETTINGS = {
    "activation_checkpointing none": {"activation_checkpointing": "none"},
    "activation_checkpointing selective": {"activation_checkpointing": "selective"},
    "activation_checkpointing full": {"activation_checkpointing": "full"},
    "compile (inductor), checkpointing none": {"activation_checkpointing": "none", "compile": True},
}


def _step_bytes(model, optimizer, ids) -> int:
    """Device memory one step needs above what is resident before it (parameters, optimizer
    state, the other model): activations, gradients, gathered or cast parameters."""
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    wl.train_step(model, optimizer, ids)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - resident


def _alternate(smp_run, plain_run, steps: int) -> tuple[float, float]:
    """Median step seconds of each, timed in alternating rounds of ROUND steps."""
    smp_times, plain_times = [], []
    for _ in range(max(1, steps // ROUND)):
        smp_times += smp_run(ROUND)
        plain_times += plain_run(ROUND)
    return statistics.median(smp_times), statistics.median(plain_times)


def run(device: torch.device, *, size: str, steps: int, out_dir: str) -> StepResult:
    work = wl.WORKLOADS[size]
    plain, params, shortfall = wl.build_if_it_fits(work, device)
    if shortfall:
        return skipped(NAME, TITLE, shortfall)
    flops_per_token = metrics.model_flops(plain).per_token(work.seq)
    peak = metrics.peak_flops(metrics.device_name(device))
    result = StepResult(NAME, TITLE, notes=[
        f"{work.shape}: {params / 1e9:.2f}B parameters, batch {work.batch} x seq {work.seq}, SDPA, "
        "bf16 autocast; smp: bf16 params + fp32 reduce at world 1; plain: the same loop without smp",
        f"peak {peak / 1e12:.0f} TFLOP/s (smp.metrics.PEAK_FLOPS)" if peak else
        "device not in smp.metrics.PEAK_FLOPS: MFU left blank",
        f"{steps} timed steps per setting after {WARMUP} warm-up steps",
    ])
    ids = wl.batch(work, plain.config.vocab_size, device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-5)
    wl.timed_steps(plain, plain_opt, ids, WARMUP)
    # The compiled baseline: the same weights, each decoder layer compiled, as the user's own loop
    # would compile it (built only when a setting compiles; its optimizer state is its own).
    plain_compiled = plain_compiled_opt = None
    best_mfu = best_plain_mfu = None
    for setting, extra in SETTINGS.items():
        compiled = bool(extra.get("compile"))
        if compiled and plain_compiled is None:
            # The compiled settings come last: the eager baseline's AdamW state (8 B a parameter)
            # goes, so that three models fit (the 1B shape on an 80 GB card).
            plain_opt = None
            gc.collect()
            torch.cuda.empty_cache()
            plain_compiled = copy.deepcopy(plain)
            for block in find_blocks(plain_compiled):
                block.compile()
            plain_compiled_opt = torch.optim.AdamW(plain_compiled.parameters(), lr=1e-5)
            wl.timed_steps(plain_compiled, plain_compiled_opt, ids, WARMUP)
        base, base_opt = (plain_compiled, plain_compiled_opt) if compiled else (plain, plain_opt)
        try:
            with smp.session({**BASE_CONFIG, **extra}, backend="nccl"):
                model = smp.transform(copy.deepcopy(plain))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                wl.timed_steps(model, opt, ids, WARMUP)
                smp_s, plain_s = _alternate(lambda n: wl.timed_steps(model, opt, ids, n),
                                            lambda n: wl.timed_steps(base, base_opt, ids, n), steps)
                smp_bytes, plain_bytes = _step_bytes(model, opt, ids), _step_bytes(base, base_opt, ids)
                del model, opt
        except torch.cuda.OutOfMemoryError as e:
            result.figures.append(Figure(f"{setting}: step time", None, "s", status="skipped",
                                         reason=f"too little GPU memory ({e})".splitlines()[0]))
            continue
        except Exception as e:  # noqa: BLE001 - this setting failed; the others still run
            result.figures.append(Figure(f"{setting}: step time", None, "s", status=FAIL, reason=f"{type(e).__name__}: {e}"))
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        achieved = work.tokens / smp_s * flops_per_token
        value = metrics.mfu(achieved, peak)
        plain_value = metrics.mfu(work.tokens / plain_s * flops_per_token, peak)
        best_mfu = value if best_mfu is None or (value or 0) > best_mfu else best_mfu
        if extra["activation_checkpointing"] == "none" and plain_value is not None:
            best_plain_mfu = max(best_plain_mfu or 0.0, plain_value)
        result.figures.append(Figure(f"{setting}: step time (smp)", smp_s, "s",
                                     reason=f"{work.tokens / smp_s:.0f} tokens/s, {achieved / 1e12:.0f} TFLOP/s"))
        ratio = smp_s / plain_s
        baseline = "plain, blocks compiled" if compiled else "plain"
        if extra["activation_checkpointing"] == "none":
            result.figures.append(check(f"{setting}: smp / {baseline} step time", ratio, ratio <= RATIO_GOAL,
                                        f"<= {RATIO_GOAL}", reason=f"{baseline} {plain_s:.4f} s"))
        else:  # the plain loop does not checkpoint: a comparison, not a goal
            result.figures.append(Figure(f"{setting}: smp / plain (no checkpointing) step time", ratio,
                                         reason=f"plain {plain_s:.4f} s"))
        result.figures.append(Figure(f"{setting}: step memory (smp)", smp_bytes / 2**30, "GiB",
                                     reason=f"{baseline}: {plain_bytes / 2**30:.2f} GiB (peak above the resident state)"))
        result.figures.append(Figure(f"{setting}: MFU", value, "fraction",
                                     reason=f"{baseline}: {plain_value:.3f}" if plain_value is not None
                                     else "peak FLOP/s unknown"))
    if best_mfu is not None and best_plain_mfu:
        result.figures.append(check("best MFU: smp / plain", best_mfu / best_plain_mfu,
                                    best_mfu / best_plain_mfu >= MFU_GOAL, f">= {MFU_GOAL}",
                                    reason=f"smp {best_mfu:.3f}, plain {best_plain_mfu:.3f} "
                                           f"({metrics.device_name(device)})"))
    else:
        result.figures.append(Figure("best MFU", best_mfu, "fraction", reason="peak FLOP/s unknown for this device"))
    del plain_compiled, plain_compiled_opt
    del plain, plain_opt
    gc.collect()
    torch.cuda.empty_cache()
    return result.finish()
