"""Step 1: world-1 checks of smp on one device (CUDA + NCCL when there is one, else CPU + gloo).

A tiny transformers Llama, fp32: smp.transform (full-shard, and a hybrid config that is
degenerate at world 1) against the same model untransformed; activation checkpointing and
offloading against none; sharded save / load / resume; bf16 Hugging Face export; delayed
(meta) initialisation against eager; bf16 params at world 1 (smp's own casts) against per-block
FSDP units, bitwise. Each check runs in its own `smp.session`.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch

import smp
from smp.gpu_check.report import FAIL, Figure, StepResult, check
from smp.testing.distributed import full_tensor, max_grad_diff
from smp.testing.models import loss_of, random_batch, tiny_llama

NAME, TITLE = "device_checks", "World-1 device checks"
TOLERANCE = 1e-5  # fp32: FSDP at world 1 changes no arithmetic, but kernels may sum in another order
BATCH, SEQ, VOCAB, SEED = 4, 32, 256, 1234


def _batch(step: int, device: torch.device) -> torch.Tensor:
    return random_batch(BATCH, SEQ, VOCAB, seed=1000 + step).to(device)


def _llama(seed: int, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_llama(use_cache=False, attention_dropout=dropout)


def _loss_and_grads(model: torch.nn.Module, batch: torch.Tensor) -> float:
    loss = loss_of(model, batch)
    loss.backward()
    return float(loss.detach())


def transform_equivalence(name: str, config: dict, device: torch.device, backend: str) -> list[Figure]:
    """Loss and gradients of smp.transform(model) vs the model untransformed, same device."""
    with smp.session(config, backend=backend):
        reference = _llama(0).to(device)
        model = smp.transform(copy.deepcopy(reference))
        batch = _batch(0, device)
        loss, ref_loss = _loss_and_grads(model, batch), _loss_and_grads(reference, batch)
        grad_diff = max_grad_diff(model, reference)
    goal = f"<= {TOLERANCE:g}"
    return [
        check(f"{name}: loss diff vs untransformed", abs(loss - ref_loss), abs(loss - ref_loss) <= TOLERANCE, goal),
        check(f"{name}: grad diff vs untransformed", grad_diff, grad_diff <= TOLERANCE, goal),
    ]


def activation_equivalence(device: torch.device, backend: str) -> list[Figure]:
    """Checkpointing (full, selective) and offloading (horizon 1) vs none: same gradients."""
    modes = {
        "checkpointing full": {"activation_checkpointing": "full"},
        "checkpointing selective": {"activation_checkpointing": "selective"},
        # min_bytes 0: a tiny model's activations are all under the 1 MiB default.
        "offloading horizon 1": {"activation_offloading": True, "activation_loading_horizon": 1,
                                 "activation_offload_min_bytes": 0},
    }
    grads = {}
    for mode, config in {"none": {}, **modes}.items():
        with smp.session(config, backend=backend):
            model = smp.transform(_llama(0))
            _loss_and_grads(model, _batch(0, device))
            grads[mode] = {n: full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}
    figures = []
    for mode in modes:
        diff = max(float((grads[mode][n] - g).abs().max()) for n, g in grads["none"].items())
        bitwise = all(torch.equal(grads[mode][n], g) for n, g in grads["none"].items())
        figures.append(check(f"{mode}: grad diff vs none", diff, diff <= TOLERANCE, f"<= {TOLERANCE:g}",
                             reason="bitwise equal" if bitwise else "not bitwise equal"))
    return figures


def exact_resume(device: torch.device, backend: str, root: str) -> list[Figure]:
    """4 steps uninterrupted vs 2 steps, save, load into another model, 2 more: with dropout,
    the losses after resume are bitwise equal only if the RNG (the CUDA one on a GPU) came back."""

    def train(model, opt, start: int, stop: int) -> list[float]:
        losses = []
        for step in range(start, stop):
            losses.append(_loss_and_grads(model, _batch(step, device)))
            opt.step()
            opt.zero_grad()
        return losses

    with smp.session({}, backend=backend):
        model = smp.transform(_llama(0, dropout=0.2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        path = os.path.join(root, "step_2")
        train(model, opt, 0, 2)
        smp.checkpointing.save(path, model, opt, extra={"step": 2})
        uninterrupted = train(model, opt, 2, 4)
        fresh = smp.transform(_llama(99, dropout=0.2))  # other weights and RNG: load must replace both
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        extra = smp.checkpointing.load(path, fresh, fresh_opt)
        resumed = train(fresh, fresh_opt, extra["step"], 4)
    diff = max(abs(a - b) for a, b in zip(uninterrupted, resumed))
    return [check("resume: loss diff after resume vs uninterrupted", diff, uninterrupted == resumed,
                  "0 (bitwise)", reason=f"losses {uninterrupted} vs {resumed}")]


def hf_export(device: torch.device, backend: str, out_dir: str) -> list[Figure]:
    """export_hf in bf16, read back by plain transformers: its logits vs the model with its
    weights rounded to bf16 the same way (so only the file round trip is measured)."""
    from transformers import LlamaForCausalLM

    with smp.session({}, backend=backend):
        model = smp.transform(_llama(0))
        smp.checkpointing.export_hf(out_dir, model, dtype=torch.bfloat16)
        rounded = {n: full_tensor(p.detach()).to(torch.bfloat16).float() for n, p in model.named_parameters()}
    loaded = LlamaForCausalLM.from_pretrained(out_dir)
    file_dtype = next(loaded.parameters()).dtype
    loaded = loaded.float().to(device).eval()
    expected = _llama(1).to(device).eval()
    expected.load_state_dict(rounded, strict=False)  # buffers (rotary) are not parameters
    ids = _batch(7, device)
    with torch.no_grad():
        diff = float((loaded(input_ids=ids).logits - expected(input_ids=ids).logits).abs().max())
    return [
        check("hf export bf16: from_pretrained dtype", str(file_dtype), file_dtype == torch.bfloat16, "torch.bfloat16"),
        check("hf export bf16: logit diff vs bf16-rounded model", diff, diff <= 1e-4, "<= 1e-4"),
    ]


def delayed_init(device: torch.device, backend: str) -> list[Figure]:
    """A model built on meta and materialised by smp.transform vs the same model built eagerly
    on the same device from the same seed: bitwise equal parameters."""
    with smp.session({"delayed_param_initialization": True, "random_seed": SEED}, backend=backend):
        torch.manual_seed(SEED)
        with torch.device(device):  # the materialised model draws from this device's generator
            eager = tiny_llama(use_cache=False)
        with smp.init_context():
            meta_model = tiny_llama(use_cache=False)
        model = smp.transform(meta_model)
        eager_params = dict(eager.named_parameters())
        diffs = [float((full_tensor(p.detach()) - eager_params[n].detach()).abs().max()) for n, p in model.named_parameters()]
        bitwise = all(torch.equal(full_tensor(p.detach()), eager_params[n].detach()) for n, p in model.named_parameters())
    return [check("delayed init: param diff vs eager", max(diffs), bitwise, "0 (bitwise)")]


def cast_layout(device: torch.device, backend: str) -> list[Figure]:
    """bf16 params + fp32 reduce at world 1: smp's layout (no FSDP units, its own casts) vs one
    FSDP unit per block, 3 AdamW steps under bf16 autocast: losses, gradients and parameters
    bitwise (docs/sharding.md, unit layout)."""
    from unittest import mock

    from smp.sharding import fsdp

    config = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
    runs = {}
    for layout in ("cast", "blocks"):
        with smp.session(config, backend=backend):
            patch = mock.patch.object(fsdp, "unit_layout", lambda *a, **k: "blocks") if layout == "blocks" else None
            with patch or contextlib.nullcontext():
                model = smp.transform(_llama(0).to(device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses, grads = [], []
            for step in range(3):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = loss_of(model, _batch(step, device))
                loss.backward()
                losses.append(float(loss.detach()))
                grads.append([full_tensor(p.grad).detach().clone() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
            runs[layout] = (losses, grads, [full_tensor(p.detach()).clone() for p in model.parameters()],
                            fsdp.describe_layout(model))
    (losses, grads, params, note), (base_losses, base_grads, base_params, _) = runs["cast"], runs["blocks"]
    grad_diff = max(float((a - b).abs().max()) for g, h in zip(grads, base_grads) for a, b in zip(g, h))
    equal = losses == base_losses and all(torch.equal(a, b) for g, h in zip(grads, base_grads) for a, b in zip(g, h)) \
        and all(torch.equal(a, b) for a, b in zip(params, base_params))
    return [check("cast layout (bf16, world 1) vs per-block FSDP units: loss, grads, params", grad_diff, equal,
                  "0 (bitwise)", reason=note.split(":")[1].split("(")[0].strip() if ":" in note else note)]


def run(device: torch.device, backend: str, work_dir: str) -> StepResult:
    result = StepResult(NAME, TITLE, notes=[
        f"device {device}, backend {backend}, world size 1",
        "multi-rank cases stay on CPU/gloo (the test suite): NCCL does not allow two ranks on one GPU",
    ])
    checks = {
        "full shard": lambda: transform_equivalence("full shard", {}, device, backend),
        "hybrid": lambda: transform_equivalence(
            "hybrid (hybrid_shard_degree 1)", {"hybrid_shard_degree": 1}, device, backend),
        "activations": lambda: activation_equivalence(device, backend),
        "resume": lambda: exact_resume(device, backend, os.path.join(work_dir, "checkpoints")),
        "hf export": lambda: hf_export(device, backend, os.path.join(work_dir, "hf_export")),
        "delayed init": lambda: delayed_init(device, backend),
        "cast layout": lambda: cast_layout(device, backend),
    }
    for name, run_check in checks.items():
        try:
            result.figures += run_check()
        except Exception as e:  # noqa: BLE001 - one crashed check fails it; the others still run
            result.figures.append(Figure(f"{name}: crashed", None, status=FAIL, reason=f"{type(e).__name__}: {e}"))
    return result.finish()
