"""FP8 (torchao float8) cases that run on every rank of a RankPool; each returns plain data.

torchao's float8 matmuls (`torch._scaled_mm`) run on CPU in torch >= 2.13, slowly; smp.init
refuses fp8 off CUDA >= 8.9, so these cases lift that refusal for their own session only
(`_fp8_allowed`). The oracle is the same float8 model in one process, fed the same rows.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from typing import Iterator
from unittest import mock

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import smp
from smp import runtime
from smp.fp8 import apply_fp8
from smp.testing.distributed import local_rows, max_grad_diff, world_mean
from smp.testing.models import TinyTransformer, random_batch, tiny_llama

# hidden 64 / intermediate 128 / 4 heads of 16 / 2 kv heads: every Linear shard under TP 2 is
# still a multiple of 16 wide (torch._scaled_mm's requirement)
GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 128


@contextmanager
def _fp8_allowed() -> Iterator[None]:
    """smp.init without its CUDA >= 8.9 check (the float8 kernels run on this CPU)."""
    with mock.patch.object(runtime, "check_fp8", lambda recipe, device: None):
        yield


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss  # TinyTransformer returns the loss


def build(kind: str) -> tuple[nn.Module, dict | None]:
    """The model and the TP plan to pass (None: its own). "user": smp's TinyTransformer, whose
    fused [q | k | v] projection takes the packed style (its matmul runs on local shards)."""
    if kind == "llama":
        return tiny_llama(vocab_size=VOCAB), None
    if kind == "user":
        from tests.tensor_parallel.tp_cases import USER_PLAN

        return TinyTransformer(vocab=VOCAB, dim=64, hidden=128), USER_PLAN
    raise ValueError(kind)


def equivalence(config: dict, recipe: str, kind: str = "llama", steps: int = 2, fp32_outputs: bool = False,
                negative: str | None = None) -> dict:
    """The float8 model under `config`'s layout vs the same float8 model in one process: the
    largest loss and gradient differences over `steps` SGD steps.

    Data parallelism: float8 scales are dynamic, taken from what each rank multiplies, so each
    rank's activation and gradient scales come from its own rows. The one-process reference
    therefore runs the data-parallel ranks' rows as separate micro-batches and averages their
    gradients (gradient accumulation), which is what the layout computes. `whole_*` report the
    gap at step 1 to one pass over the whole batch instead (scales over all rows).

    `fp32_outputs` (both sides): rowwise matmuls return float32 instead of torchao's bfloat16
    (`_fp32_rowwise_outputs`). `negative`: "no_fp8" leaves the reference in float32 (the swap
    skipped on one side); "local_amax" scales each TP rank's float8 casts by its own shard's amax.
    """
    with ExitStack() as stack:
        stack.enter_context(_fp8_allowed())
        if fp32_outputs:
            stack.enter_context(_fp32_rowwise_outputs())
        if negative == "local_amax":
            stack.enter_context(_local_amax())
        stack.enter_context(smp.session(dict(config, fp8={"recipe": recipe})))
        torch.manual_seed(smp.state.config.random_seed)
        base, plan = build(kind)
        reference = copy.deepcopy(base)
        converted = apply_fp8(reference, recipe) if negative != "no_fp8" else []
        model = smp.transform(base, tp_plan=plan)
        report = {"converted": len(converted), "loss_diff": 0.0, "grad_diff": 0.0, "losses": [],
                  "fp8_layers": sum(isinstance(m, _float8_linear()) for m in model.modules()),
                  "tp_sharded": sum(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
                                    for p in model.parameters())}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
        dp = smp.state.dp_size
        whole = copy.deepcopy(reference) if dp > 1 else None
        for _ in range(steps):
            loss = _loss(model, local_rows(batch))
            loss.backward()
            ref_loss = sum(_loss(reference, rows) / dp for rows in batch.chunk(dp))
            ref_loss.backward()
            if whole is not None:  # step 1 only
                whole_loss = _loss(whole, batch)
                whole_loss.backward()
                report["whole_loss_diff"] = abs(world_mean(loss) - float(whole_loss.detach()))
                report["whole_grad_diff"] = max_grad_diff(model, whole)
                whole = None
            report["losses"].append(float(ref_loss.detach()))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss.detach())))
            report["grad_diff"] = max(report["grad_diff"], max_grad_diff(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        return report


def transform_error(config: dict, recipe: str, kind: str) -> str:
    """The ConfigError smp.transform raises for this float8 model and layout ('' if none)."""
    with _fp8_allowed(), smp.session(dict(config, fp8={"recipe": recipe})):
        model, plan = build(kind)
        try:
            smp.transform(model, tp_plan=plan)
        except smp.ConfigError as e:
            return str(e)
        return ""


@contextmanager
def _fp32_rowwise_outputs() -> Iterator[None]:
    """torchao returns a rowwise-scaled matmul in bfloat16 (cuBLAS has no float32 output for it),
    so under TP each rank's partial sum is rounded to bfloat16 before the all-reduce, where one
    process rounds the total once. Here the product stays float32 (the CPU kernel allows it), so
    what is left between the layouts is the scales and the order of the sums."""
    from torchao.float8 import float8_ops

    real = float8_ops.addmm_float8_unwrapped

    def fp32(a_data, a_scale, b_data, b_scale, output_dtype, output_scale=None, bias=None, use_fast_accum=False):
        rowwise = a_scale.shape == (a_data.shape[0], 1) and b_scale.shape == (1, b_data.shape[1])
        if not (rowwise and output_dtype == torch.float32):
            return real(a_data, a_scale, b_data, b_scale, output_dtype, output_scale, bias, use_fast_accum)
        one = a_scale.new_ones(())
        out = torch._scaled_mm(a_data, b_data, scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = out * (a_scale.reciprocal() * b_scale.reciprocal())
        return out if bias is None else out + bias

    with mock.patch.object(float8_ops, "addmm_float8_unwrapped", fp32):
        yield


@contextmanager
def _local_amax() -> Iterator[None]:
    """Mutation: each TP rank casts what it multiplies (inputs, weights, output gradients) with
    scales from its own shard: the amax all-reduce over the TP group left out."""
    from torchao.float8 import float8_linear

    real = float8_linear.hp_tensor_to_float8_dynamic

    def local_scale(hp, *args, **kwargs):
        if isinstance(hp, DTensor):
            local = real(hp.to_local(), *args, **kwargs)
            return DTensor.from_local(local, hp.device_mesh, hp.placements, run_check=False,
                                      shape=hp.shape, stride=hp.stride())
        return real(hp, *args, **kwargs)

    with mock.patch.object(float8_linear, "hp_tensor_to_float8_dynamic", local_scale):
        yield


def _float8_linear() -> type:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear
