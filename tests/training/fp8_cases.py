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
from smp.expert_parallel import is_expert_parallel
from smp.fp8 import apply_fp8
from smp.testing.distributed import full_tensor, local_rows, max_grad_diff, world_mean
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
    if kind in ("mixtral", "qwen2_moe"):
        return _moe(kind), None
    raise ValueError(kind)


def _moe(kind: str) -> nn.Module:
    """The expert-parallel tests' tiny MoE models without the load-balancing loss: its router
    statistics are summed over the data-parallel ranks, which per-rank micro-batches in one
    process are not. Converted to float8: the attention projections (and Qwen2-MoE's shared
    expert); the experts are [E, ...] parameters and the routers no Linear, both left as they are."""
    from tests.expert_parallel.expert_parallel_cases import build as build_moe

    return build_moe(kind, vocab_size=VOCAB, output_router_logits=False)


def equivalence(config: dict, recipe: str, kind: str = "llama", steps: int = 2, fp32_outputs: bool = False,
                negative: str | None = None, all_gather: bool = False) -> dict:
    """The float8 model under `config`'s layout vs the same float8 model in one process: the
    largest loss and gradient differences over `steps` SGD steps.

    Data parallelism: float8 scales are dynamic, taken from what each rank multiplies, so each
    rank's activation and gradient scales come from its own rows. The one-process reference
    therefore runs the data-parallel ranks' rows as separate micro-batches and averages their
    gradients (gradient accumulation), which is what the layout computes. `whole_*` report the
    gap at step 1 to one pass over the whole batch instead (scales over all rows).

    `fp32_outputs` (both sides): rowwise matmuls return float32 instead of torchao's bfloat16
    (`_fp32_rowwise_outputs`). `negative`: "no_fp8" leaves the reference in float32 (the swap
    skipped on one side); "local_amax" scales each TP rank's float8 casts by its own shard's amax;
    "shard_weight_scale" casts each FSDP shard of a weight by its own amax before the float8
    all-gather (torchao's amax all-reduce over the FSDP mesh left out).

    `all_gather`: `fp8.all_gather: true` (FSDP gathers the weights in float8). The report then
    counts the float8 gathers (`fp8_gathers`, per step) and holds the last step's whole
    gradients (`grads`, rank 0) for the comparison with the same run without it.
    """
    with ExitStack() as stack:
        stack.enter_context(_fp8_allowed())
        if fp32_outputs:
            stack.enter_context(_fp32_rowwise_outputs())
        if negative == "local_amax":
            stack.enter_context(_local_amax())
        if negative == "shard_weight_scale":
            stack.enter_context(_shard_weight_scale())
        gathers = stack.enter_context(_count_fp8_gathers())
        stack.enter_context(smp.session(dict(config, fp8={"recipe": recipe, "all_gather": all_gather})))
        torch.manual_seed(smp.state.config.random_seed)
        base, plan = build(kind)
        reference = copy.deepcopy(base)
        converted = apply_fp8(reference, recipe) if negative != "no_fp8" else []
        model = smp.transform(base, tp_plan=plan)
        report = {"converted": len(converted), "loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "fp8_gathers": [],
                  "fp8_layers": sum(isinstance(m, _float8_linear()) for m in model.modules()),
                  "tp_sharded": sum(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
                                    for p in model.parameters()),
                  "expert_parallel": sum(is_expert_parallel(m) for m in model.modules()),
                  "dp_shard": smp.state.dims.dp_shard, "dp_replicate": smp.state.dims.dp_replicate}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
        dp = smp.state.dp_size
        whole = copy.deepcopy(reference) if dp > 1 else None
        for _ in range(steps):
            before = gathers[0]
            loss = _loss(model, local_rows(batch))
            loss.backward()
            report["fp8_gathers"].append(gathers[0] - before)
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
            grads = {n: full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        if torch.distributed.get_rank() == 0:
            report["grads"] = grads
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


@contextmanager
def _count_fp8_gathers() -> Iterator[list[int]]:
    """How many times FSDP cast a weight shard to float8 for its all-gather (torchao's
    `fsdp_pre_all_gather`): [count], read while the context is open."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    count = [0]
    real = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def counted(self, mesh):
        count[0] += 1
        return real(self, mesh)

    with mock.patch.object(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", counted):
        yield count


@contextmanager
def _shard_weight_scale() -> Iterator[None]:
    """Mutation: each FSDP rank casts its shard of a weight to float8 with the shard's own amax
    before the float8 all-gather (the amax all-reduce over the FSDP mesh left out)."""
    from torchao.float8 import fsdp_utils

    real = fsdp_utils.hp_tensor_to_float8_dynamic

    def shard_scale(*args, **kwargs):
        return real(*args, **dict(kwargs, reduce_amax=False))

    with mock.patch.object(fsdp_utils, "hp_tensor_to_float8_dynamic", shard_scale):
        yield


def _float8_linear() -> type:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def checkpoint_round_trip(folder: str) -> dict:
    """`fp8.all_gather` under FSDP: what smp's checkpoint writes, `full_state_dict` and `export_hf`
    give (tensor classes and dtypes: plain float32 expected), and an exact resume: step 2 after
    `smp.checkpointing.load` of the checkpoint saved after step 1 vs step 2 without it."""
    from smp.checkpointing.sharded import _state_dicts
    from smp.integrations.saving import full_state_dict

    def classes(state: dict) -> set[str]:
        out = set()
        for value in state.values():
            if isinstance(value, dict):
                out |= classes(value)
            elif isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                out.add(f"{type(local).__name__}:{str(local.dtype).removeprefix('torch.')}")
        return out

    with _fp8_allowed(), smp.session({"fp8": {"recipe": "tensorwise", "all_gather": True}}):
        torch.manual_seed(smp.state.config.random_seed)
        model = smp.transform(build("llama")[0])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100))

        def step() -> float:
            loss = _loss(model, rows)
            loss.backward()
            opt.step(), opt.zero_grad()
            return float(loss.detach())

        step()
        report = {"saved": sorted(classes(_state_dicts(model, opt))),
                  "model_params": sorted(classes(dict(model.named_parameters()))),
                  "full": sorted(classes(full_state_dict(model)))}
        smp.checkpointing.save(f"{folder}/ckpt", model, opt)
        smp.checkpointing.export_hf(f"{folder}/hf", model)
        loss, params = step(), {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        smp.checkpointing.load(f"{folder}/ckpt", model, opt)
        with _count_fp8_gathers() as gathers:
            report["resumed_loss_diff"] = abs(step() - loss)
        report["resumed_param_diff"] = max(float((full_tensor(p.detach()) - params[n]).abs().max())
                                           for n, p in model.named_parameters())
        report["gathers_after_load"] = gathers[0]
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            from pathlib import Path

            from safetensors.torch import load_file

            files = [f for f in Path(folder).rglob("*") if f.is_file()]
            report["files_naming_torchao"] = sorted(str(f.relative_to(folder)) for f in files
                                                    if b"torchao" in f.read_bytes())
            exported = {}
            for f in Path(folder, "hf").glob("*.safetensors"):
                exported.update(load_file(f))
            report["exported"] = sorted(classes(exported))
        return report
