"""Step 6 (CUDA of compute capability >= 8.9, torchao): FP8 training against bf16.

The check's Llama trained through smp.transform at world 1 (bf16 params + fp32 reduce, blocks
compiled: torchao's float8 casts are fused only under compile, so an eager fp8 step measures
the casts, not the matmuls) three times from the same weights on the same batches: bf16, then
`fp8: {recipe: tensorwise}` and `rowwise`. The batches are a few fixed ones cycled, so the loss
falls well below its starting value within the run and a numerical problem shows as a gap.

Figures: per recipe, the loss gap to bf16 (mean over the last LAST_STEPS steps, relative:
goal <= LOSS_GOAL; float8 with dynamic scales tracks bf16 closely, a broken scale does not),
and the step time and MFU against bf16's (MFU against the device's bf16 peak, as torchtitan
reports it). Speed is reported, not judged: the gain depends on the matmul sizes, and at the
1B shape's widths the cast overhead takes a part of it.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

import smp
from smp import metrics
from smp.errors import ConfigError
from smp.fp8 import RECIPES, check_fp8
from smp.gpu_check import workload as wl
from smp.gpu_check.report import FAIL, Figure, StepResult, check, skipped

NAME, TITLE = "fp8_training", "FP8 training (torchao float8) vs bf16"
TRAIN_STEPS, LAST_STEPS, BATCHES = 30, 10, 4
LOSS_GOAL = 0.02  # |fp8 - bf16| / bf16 loss, mean of the last LAST_STEPS steps
LR = 3e-4
BASE_CONFIG = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}, "compile": True}


def _step(model, optimizer, ids) -> torch.Tensor:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _train(initial: torch.nn.Module, extra: dict, batches: list[torch.Tensor], timed: int) -> tuple[list[float], float]:
    """(losses of TRAIN_STEPS steps, median seconds of `timed` more) through smp under `extra`."""
    with smp.session({**BASE_CONFIG, **extra}, backend="nccl"):
        model = smp.transform(copy.deepcopy(initial))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = [_step(model, optimizer, batches[i % len(batches)]) for i in range(TRAIN_STEPS)]
        losses = [float(v) for v in losses]
        times = []
        for i in range(timed):
            torch.cuda.synchronize()
            start = time.perf_counter()
            _step(model, optimizer, batches[i % len(batches)])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return losses, statistics.median(times)


def run(device: torch.device, *, size: str, steps: int, out_dir: str) -> StepResult:
    try:
        check_fp8(RECIPES[0], device)
    except ConfigError as e:  # no torchao, or a device without float8 matmuls: smp.init's own refusal
        return skipped(NAME, TITLE, str(e))
    work = wl.WORKLOADS[size]
    torch.manual_seed(0)
    initial, params, shortfall = wl.build_if_it_fits(work, device)
    if shortfall:
        return skipped(NAME, TITLE, shortfall)
    vocab = initial.config.vocab_size
    batches = [wl.batch(work, vocab, device, seed=s) for s in range(BATCHES)]
    flops_per_token = metrics.model_flops(initial).per_token(work.seq)
    peak = metrics.peak_flops(metrics.device_name(device))
    result = StepResult(NAME, TITLE, notes=[
        f"{work.shape}: {params / 1e9:.2f}B parameters, batch {work.batch} x seq {work.seq}, world 1, "
        f"bf16 params + fp32 reduce, blocks compiled, AdamW lr {LR}; {TRAIN_STEPS} steps over {BATCHES} "
        f"fixed batches, then {steps} timed",
        "MFU against the bf16 peak" if peak else "device not in smp.metrics.PEAK_FLOPS: MFU left blank",
    ])
    runs = {"bf16": {}, **{f"fp8 {recipe}": {"fp8": {"recipe": recipe}} for recipe in RECIPES}}
    measured: dict[str, tuple[list[float], float]] = {}
    for setting, extra in runs.items():
        try:
            measured[setting] = _train(initial, extra, batches, steps)
        except torch.cuda.OutOfMemoryError as e:
            result.figures.append(Figure(f"{setting}: step time", None, "s", status="skipped",
                                         reason=f"too little GPU memory ({e})".splitlines()[0]))
        except Exception as e:  # noqa: BLE001 - this setting failed; the others still run
            result.figures.append(Figure(f"{setting}: step time", None, "s", status=FAIL,
                                         reason=f"{type(e).__name__}: {e}".splitlines()[0]))
    if "bf16" not in measured:
        return result.finish()
    bf16_losses, bf16_s = measured["bf16"]
    bf16_tail = statistics.fmean(bf16_losses[-LAST_STEPS:])
    result.figures.append(Figure("bf16: loss, first and last step", f"{bf16_losses[0]:.4f} -> {bf16_losses[-1]:.4f}"))
    for setting, (losses, seconds) in measured.items():
        mfu = metrics.mfu(work.tokens / seconds * flops_per_token, peak)
        result.figures.append(Figure(f"{setting}: step time", seconds, "s",
                                     reason=f"{work.tokens / seconds:.0f} tokens/s, MFU {mfu:.3f}" if mfu is not None
                                     else f"{work.tokens / seconds:.0f} tokens/s"))
        if setting == "bf16":
            continue
        gap = abs(statistics.fmean(losses[-LAST_STEPS:]) - bf16_tail) / bf16_tail
        result.figures.append(check(f"{setting}: loss gap to bf16 (last {LAST_STEPS} steps)", gap, gap <= LOSS_GOAL,
                                    f"<= {LOSS_GOAL}", reason=f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"))
        result.figures.append(Figure(f"{setting}: step time / bf16", seconds / bf16_s, "x"))
    del initial
    gc.collect()
    torch.cuda.empty_cache()
    return result.finish()
