"""Functions that run on every rank of a RankPool for the smp_collectives tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import smp
import smp_collectives as sc
from smp_collectives import counters
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import build, loss_of, pattern_batch, random_batch


def _groups(split: bool) -> list[dist.ProcessGroup | None]:
    """[world group] or, split, the two interleaved halves {0,2,..} / {1,3,..} (every rank
    must create both); returns the group this rank belongs to."""
    if not split:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    evens = dist.new_group(list(range(0, world, 2)))
    odds = dist.new_group(list(range(1, world, 2)))
    return evens if rank % 2 == 0 else odds


def ring_vs_default(split: bool = False, cols: int = 37) -> dict:
    """Ring collectives vs the process group's own, on integer-valued fp32 inputs (exact sums)."""
    group = _groups(split)
    n = dist.get_world_size(group)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    x = torch.randint(-1000, 1000, (n * cols,), generator=g).float()
    out = {}
    for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        mine, ref = torch.empty(cols), torch.empty(cols)
        counters.reset()
        sc.RingReduceScatter()(output_tensor=mine, input_tensor=x, group=group, op=op)
        out[f"rs_bytes_{op_name}"] = counters.bytes_sent("ring.reduce_scatter")
        dist.reduce_scatter_single(ref, x, op=op, group=group)
        out[f"rs_equal_{op_name}"] = torch.equal(mine, ref)
    shard = x[:cols]
    ag, ref = torch.empty(n * cols), torch.empty(n * cols)
    counters.reset()
    assert sc.RingAllGather()(output_tensor=ag, input_tensor=shard, group=group) is None
    out["ag_bytes"] = counters.bytes_sent("ring.all_gather")
    dist.all_gather_single(ref, shard, group=group)
    out["ag_equal"] = torch.equal(ag, ref)
    y, ref = x[: 5 * n + 3].clone(), x[: 5 * n + 3].clone()  # not a multiple of n: padding path
    sc.ring.all_reduce(y, group)
    dist.all_reduce(ref, group=group)
    out["ar_equal"] = torch.equal(y, ref)
    out["size_bytes"] = x.numel() * 4
    out["n"] = n
    return out


def quantized_reduce_scatter_case(kind: str, block: int, cols: int, impl: str) -> dict:
    """int8/fp8 reduce-scatter vs the exact one: error within the summed per-block bounds."""
    n, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(2000 + rank)
    # Magnitudes spread over 6 decades across blocks, like real gradients of different layers.
    x = torch.randn(n * cols, generator=g) * torch.logspace(-4, 2, n * cols)[torch.randperm(n * cols, generator=g)]
    exact = torch.empty(cols)
    dist.reduce_scatter_single(exact, x.clone(), op=dist.ReduceOp.AVG)
    got = torch.empty(cols)
    counters.reset()
    sc.quantized_reduce_scatter(got, x, None, dist.ReduceOp.AVG, kind=kind, block=block, impl=impl)
    sent = counters.bytes_sent()
    # Bound for destination j: (sum over senders of their per-element bound) / n, plus fp32
    # rounding of the accumulation itself.
    _, scale = sc.quantize(x.view(n, cols), block, kind, impl="torch")
    bound = sc.error_bound(x.view(n, cols), scale, block, kind)
    dist.all_reduce(bound)
    bound = bound[rank] / n + 1e-6 * exact.abs() + 1e-30
    err = (got - exact).abs()
    return {
        "within_bound": bool((err <= bound).all()),
        "max_err_over_bound": float((err / bound).max()),
        "max_err": float(err.max()),
        "bytes": sent,
        "expected_bytes": sc.quantized_bytes(x.numel(), n, block),
        "fp32_bytes": sc.fp32_bytes_bound(x.numel(), n),
        "result": got,
    }


def cross_replica_hook_case(kind: str | None) -> torch.Tensor:
    """CrossReplicaAllReduce on its own: returns the averaged tensor (must be equal on all ranks)."""
    g = torch.Generator().manual_seed(3000 + dist.get_rank())
    x = torch.randn(1000, generator=g)
    counters.reset()
    sc.CrossReplicaAllReduce(None, kind, block=64, error_feedback=False)(x)
    return x


# ------------------------------------------------------------------------------------------
# Through smp.transform


def train_grads(config: dict, kind: str, steps: int = 2) -> dict:
    """`steps` SGD steps through smp.transform: per-step global-mean loss, final full gradients,
    sync bytes of the last step. Runs the single-process reference alongside for comparison."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        vocab = 256 if kind == "llama" else 128
        losses, ref_losses, grad_diff, sent = [], [], 0.0, {}
        for step in range(steps):
            smp.gradient_sync_bytes(reset=True)
            batch = random_batch(8, 16, vocab, seed=100 + step)
            loss = loss_of(model, local_rows(batch))
            loss.backward()
            sent = smp.gradient_sync_bytes()
            ref_loss = loss_of(reference, batch)
            ref_loss.backward()
            losses.append(world_mean(loss))
            ref_losses.append(float(ref_loss))
            ref_grads = dict(reference.named_parameters())
            grads = {name: full_tensor(p.grad).clone() for name, p in model.named_parameters()}
            grad_diff = max(grad_diff, max(float((grads[k] - ref_grads[k].grad).abs().max()) for k in grads))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        return {"losses": losses, "ref_losses": ref_losses, "grad_diff": grad_diff, "grads": grads, "bytes": sent}


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
