"""Functions that run on every rank of a RankPool for the parameter-gather tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import smp
import smp_collectives as sc
from smp._compat import fsdp_unit_params
from smp.planning.communication import comm_bytes_per_step
from smp.sharding.parameter_gather import install_parameter_gather, parameter_gather_bytes
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import build, loss_of, pattern_batch, random_batch
from smp_collectives import counters
from smp_collectives import quantization as Q
from smp_collectives.parameter_gather import gather_bytes


def shard(cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Parameter-like values: magnitudes over 4 decades across blocks, a zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cols, generator=g) * torch.logspace(-3, 1, cols)[torch.randperm(cols, generator=g)]
    x[:32] = 0.0
    return x.to(dtype)


def gather_case(kind: str, dtype: torch.dtype, block: int, cols: int, impl: str, group_size: int | None = None) -> dict:
    """ParameterAllGather vs the exact all-gather of the same shards: every value within its
    bound, bytes = formula, every rank holding the same result. `group_size`: gather inside
    consecutive groups of that many ranks (one HSDP replica's shard group), not the world."""
    group = dist.new_subgroups(group_size)[0] if group_size else None
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = shard(cols, dtype, seed=4000 + dist.get_rank())
    exact = torch.empty(n * cols, dtype=dtype)
    dist.all_gather_into_tensor(exact, mine, group=group)
    out = torch.empty(n * cols, dtype=dtype)
    out[rank * cols : (rank + 1) * cols].copy_(mine)  # FSDP's input is a view of the output's own row
    counters.reset()
    comm = sc.ParameterAllGather(kind, block, impl=impl)
    assert comm(output_tensor=out, input_tensor=out[rank * cols : (rank + 1) * cols], group=group) is None
    sent = counters.bytes_sent()
    x = exact.float().view(n, cols)
    _, scale = Q.quantize_torch(x, block, kind)
    bound = sc.error_bound(x, scale, block, kind).view(-1)
    if dtype != torch.float32:  # one rounding of the decoded value to the parameter dtype
        bound = bound + out.float().abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11)
    err = (out.float() - exact.float()).abs()
    return {
        "within_bound": bool((err <= bound).all()),
        "max_err_over_bound": float((err / (bound + 1e-30)).max()),
        "max_err": float(err.max()),
        "bytes": sent,
        "expected_bytes": gather_bytes(cols, n, block),
        "exact_bytes": (n - 1) * cols * exact.element_size(),
        "result": out,
    }


class ReferenceGather:
    """The torch reference of the same codes: an exact all-gather, then every row quantised and
    dequantised by quantization.py's torch functions and cast to the parameter dtype."""

    def __init__(self, kind: str, block: int, compress_ranks: int):
        self.kind, self.block, self.compress_ranks = kind, block, compress_ranks

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n = dist.get_world_size(group)
        dist.all_gather_into_tensor(output_tensor, input_tensor.clone(), group=group)
        if n != self.compress_ranks:
            return None
        rows = output_tensor.view(n, -1).float()
        q, s = Q.quantize_torch(rows, self.block, self.kind)
        output_tensor.view(n, -1).copy_(Q.dequantize_torch(q, s, self.block, self.kind))
        return None


class DroppedScaleGather(sc.ParameterAllGather):
    """Negative control: the message's first scale is lost (every later block takes its
    neighbour's scale), as a decoder reading the scales one block off would."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        from smp_collectives import parameter_gather as PG

        n, cols = dist.get_world_size(group), input_tensor.numel()
        width = PG.message_width(cols, self.block)
        send = torch.empty(width, dtype=torch.uint8)
        PG.encode_shard(input_tensor, self.block, self.kind, send, impl=self.impl)
        nb = PG.num_blocks(cols, self.block)
        scales = send[: 4 * nb].view(torch.float32)
        scales[:-1] = scales[1:].clone()
        recv = torch.empty(n * width, dtype=torch.uint8)
        dist.all_gather_into_tensor(recv, send, group=group)
        PG.decode_message(recv.view(n, width), cols, self.block, self.kind, output_tensor, impl=self.impl)
        return None


def _swap_gather(model: torch.nn.Module, make) -> None:
    """Replace every FSDP unit's all-gather by make(shard ranks)."""
    for m in model.modules():
        params = fsdp_unit_params(m) if isinstance(m, FSDPModule) else None
        if params and params[0].mesh_info.shard_mesh_size > 1:
            m.set_custom_all_gather(make(params[0].mesh_info.shard_mesh_size))


def train(config: dict, kind: str = "llama", steps: int = 2, swap: str | None = None, impl: str = "auto") -> dict:
    """`steps` SGD steps through smp.transform: per-step global-mean loss, final full gradients,
    parameter-gather bytes per step (measured and planned). swap: replace the installed gathers
    by "reference" (ReferenceGather), "impl" (ParameterAllGather with `impl`) or "dropped_scale"."""
    with smp.session(config):
        cfg = smp.state.config
        torch.manual_seed(cfg.random_seed)
        model = smp.transform(build(kind))
        gather = cfg.parameter_gather
        if swap == "reference":
            _swap_gather(model, lambda n: ReferenceGather(gather.algorithm, gather.block_size, n))
        elif swap == "impl":
            _swap_gather(model, lambda n: sc.ParameterAllGather(gather.algorithm, gather.block_size, impl, n))
        elif swap == "dropped_scale":
            _swap_gather(model, lambda n: DroppedScaleGather(gather.algorithm, gather.block_size, impl, n))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        vocab = 256 if kind == "llama" else 128
        losses, sent = [], {}
        for step in range(steps):
            parameter_gather_bytes(reset=True)
            batch = random_batch(8, 16, vocab, seed=100 + step)
            loss = loss_of(model, local_rows(batch))
            loss.backward()
            sent = parameter_gather_bytes()
            losses.append(world_mean(loss))
            grads = {name: full_tensor(p.grad).float().clone() for name, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        planned = comm_bytes_per_step(model, cfg, smp.state.dims)["all_gather"]
        return {"losses": losses, "grads": grads, "bytes": sent, "planned_all_gather": planned,
                **_post_forward_groups(model)}


def _post_forward_groups(model: torch.nn.Module) -> dict:
    """The groups FSDP units keep their shards over between forward and backward where that is
    narrower than their shard group (hpZ): every rank list, and how many meshes hold them."""
    infos = [params[0].post_forward_mesh_info for m in model.modules()
             if isinstance(m, FSDPModule) and (params := fsdp_unit_params(m))
             and params[0].post_forward_mesh_info not in (None, params[0].mesh_info)]
    return {"node_groups": sorted({tuple(dist.get_process_group_ranks(i.shard_process_group)) for i in infos}),
            "node_meshes": len({id(i.mesh) for i in infos}), "narrowed_units": len(infos)}


def refusal(config: dict, kind: str = "plain", param_dtype: torch.dtype | None = None) -> str:
    """The ConfigError text of transform (or, with param_dtype, of the install) under `config`."""
    with smp.session(config):
        model = build(kind)
        try:
            model = smp.transform(model)
            if param_dtype is not None:
                install_parameter_gather(model, "int8", block_size=256, hierarchical=False, param_dtype=param_dtype)
        except smp.ConfigError as e:
            return str(e)
        return ""


def loss_curve(config: dict, steps: int) -> list[float]:
    """Global-mean training loss per step of a tiny Llama (AdamW) under `config`."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        model = smp.transform(build("llama"))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(7)
        curve = []
        for _ in range(steps):
            batch = pattern_batch(g, 8, 16, 256)
            loss = loss_of(model, local_rows(batch))
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(world_mean(loss))
        return curve
