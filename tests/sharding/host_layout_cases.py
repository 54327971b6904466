"""Rank functions for tests/sharding/test_host_layout.py: smp's unit layouts (one-rank cast layout, merged
FSDP units) against today's one FSDP unit per block, bitwise."""

from __future__ import annotations

import contextlib
import copy
import types
from unittest import mock

import torch

import smp
from smp.sharding import cast_params, fsdp
from smp.testing.distributed import full_tensor, local_rows
from smp.testing.models import random_batch, tiny_llama

BF16 = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}


class ToyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x * self.w) + x


class Toy(torch.nn.Module):
    """Its blocks receive float32 inputs (the embedding's output scaled by a float32 buffer): only
    the per-block input cast FSDP's units do makes them compute in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 16)
        self.register_buffer("scale", torch.full((16,), 1.1))
        self.layers = torch.nn.ModuleList([ToyBlock() for _ in range(4)])
        self.head = torch.nn.Linear(16, 256)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids).float() * self.scale
        for layer in self.layers:
            x = layer(x)
        loss = torch.nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), labels.flatten())
        return types.SimpleNamespace(loss=loss)


@contextlib.contextmanager
def per_block_units():
    """Today's layout: one FSDP unit per block, whatever the shard group."""
    with mock.patch.object(fsdp, "unit_layout", lambda *a, **k: "blocks"):
        yield


@contextlib.contextmanager
def broken(variant: str | None):
    """Deliberately wrong layouts the comparison must catch."""
    if variant is None:
        yield
    elif variant == "no_param_cast":  # casts at the wrong point: autocast alone, fp32 weights
        with mock.patch.object(cast_params.CastParameters, "pre_forward", lambda *a: None):
            yield
    elif variant == "block_inputs_uncast":  # FSDP's per-block input cast left out
        with mock.patch.object(cast_params.CastParameters, "cast_unit_inputs", lambda self, m, a, k: (a, k)):
            yield
    elif variant == "bf16_reduce":  # FSDP units with the fp32 reduce dropped
        policy = fsdp.MixedPrecisionPolicy
        with mock.patch.object(fsdp, "MixedPrecisionPolicy",
                               lambda **k: policy(**{**k, "reduce_dtype": torch.bfloat16})):
            yield
    else:
        yield  # variants applied in the step (bf16_accumulation)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _train(model, *, steps: int, micro_batches: int, variant: str | None, layers_seed: int = 100) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        for micro in range(micro_batches):
            batch = local_rows(random_batch(8, 16, 256, seed=layers_seed + 10 * step + micro))
            with contextlib.nullcontext() if micro == micro_batches - 1 else smp.no_sync(model):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
            losses.append(loss.detach().float().clone())
            if variant == "bf16_accumulation":  # the fp32 reduce dropped: gradients summed in bf16
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.copy_(p.grad.to(torch.bfloat16))
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": _snapshot(model)}


def _units(model) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def layout_vs_per_block(config: dict, *, layers: int = 4, steps: int = 3, micro_batches: int = 1,
                        variant: str | None = None, compile_backend: str | None = None,
                        min_unit_bytes: int | None = None, kind: str = "llama") -> dict:
    """The same model trained twice with AdamW under bf16 autocast: once in today's layout (one
    FSDP unit per block), once in the layout smp picks. Returns whether every loss, every
    gradient and every parameter after the steps is bitwise equal, and the layouts' unit counts."""
    cfg = {**config}
    if compile_backend:
        cfg["compile"] = {"enabled": True, "backend": compile_backend}
    with smp.session(cfg):
        torch.manual_seed(0)
        reference = tiny_llama(num_hidden_layers=layers) if kind == "llama" else Toy()
        with per_block_units():
            base = smp.transform(copy.deepcopy(reference))
        patch = mock.patch.object(fsdp, "MIN_UNIT_BYTES", min_unit_bytes) if min_unit_bytes is not None \
            else contextlib.nullcontext()
        with patch, broken(variant):
            model = smp.transform(copy.deepcopy(reference))
            got = _train(model, steps=steps, micro_batches=micro_batches, variant=variant)
        want = _train(base, steps=steps, micro_batches=micro_batches, variant=None)
        loss_equal = all(torch.equal(a, b) for a, b in zip(got["losses"], want["losses"]))
        grads_equal = all(g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
                          for g, w in zip(got["grads"], want["grads"]))
        params_equal = all(torch.equal(got["params"][k], want["params"][k]) for k in want["params"])
        grad_diff = max(float((g[k] - w[k]).abs().max()) for g, w in zip(got["grads"], want["grads"]) for k in w
                        if k in g)
        return {
            "loss_equal": loss_equal, "grads_equal": grads_equal, "params_equal": params_equal,
            "grad_diff": grad_diff, "grad_count": len(want["grads"][0]),
            "units": _units(model), "base_units": _units(base),
            "layout": fsdp.describe_layout(model),
            "param_types": sorted({type(p).__name__ for p in model.parameters()}),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        }


def reads_after_step(config: dict) -> dict:
    """What code that reads the model sees after a step in the cast layout: parameters (type,
    dtype), state dict dtypes, clip_grad_norm_ vs torch's, and an eval forward that restores."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_llama(num_hidden_layers=2))
        batch = random_batch(4, 16, 256, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        during = sorted({str(p.dtype) for p in model.parameters()})
        loss.backward()
        after = sorted({str(p.dtype) for p in model.parameters()})
        grads = [p.grad.clone() for p in model.parameters()]
        want = torch.nn.utils.get_total_norm(grads)
        norm = smp.clip_grad_norm_(model, 1e9)
        with torch.no_grad():
            model(input_ids=batch)
        after_eval = sorted({str(p.dtype) for p in model.parameters()})
        state = sorted({str(v.dtype) for v in model.state_dict().values() if v.is_floating_point()})
        return {"during": during, "after": after, "after_eval": after_eval, "state": state,
                "norm_equal": bool(torch.equal(norm, want)), "grad_dtypes": sorted({str(g.dtype) for g in grads})}
