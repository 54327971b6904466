"""Functions that run on every rank of a RankPool. Each returns plain data to the test."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import smp
from smp.testing.distributed import full_tensor, local_rows, local_tensor, max_grad_diff, world_mean
from smp.testing.models import build, loss_of, random_batch

GLOBAL_BATCH, SEQ = 8, 16


def equivalence(config: dict, kind: str, steps: int = 2, break_sync: bool = False,
                delayed: bool = False) -> dict:
    """Sharded run vs the single-process run on the same init and global batch.

    Returns the largest loss and gradient differences over `steps` SGD steps. `break_sync`
    turns off gradient reduction, which the comparison must catch.
    """
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        if delayed:
            with torch.device("meta"):
                model = build(kind)
        else:
            model = copy.deepcopy(reference)
        model = smp.transform(model)
        if break_sync:
            for m in model.modules():
                if hasattr(m, "set_custom_reduce_scatter"):
                    m.set_custom_reduce_scatter(_LocalOnlyReduceScatter())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        vocab = 128 if kind == "plain" else 256

        report = {"loss_diff": 0.0, "grad_diff": 0.0, "param_diff": 0.0, "losses": []}
        for p_ref, (name, p) in zip(reference.parameters(), model.named_parameters()):
            report["param_diff"] = max(report["param_diff"], float((full_tensor(p.detach()) - p_ref.detach()).abs().max()))
        for step in range(steps):
            batch = random_batch(GLOBAL_BATCH, SEQ, vocab, seed=100)  # same batch: loss must fall
            loss = loss_of(model, local_rows(batch))
            loss.backward()
            ref_loss = loss_of(reference, batch)
            ref_loss.backward()
            report["losses"].append(float(ref_loss))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
            report["grad_diff"] = max(report["grad_diff"], max_grad_diff(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        return report


class _LocalOnlyReduceScatter:
    """A broken gradient sync: each rank keeps its own chunk, never adding the others'."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        rank = dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[rank])


def describe_state(config: dict) -> dict:
    with smp.session(config):
        s = smp.state
        return dict(
            rank=s.rank, world_size=s.world_size, dp_rank=s.dp_rank, dp_size=s.dp_size,
            tp_rank=s.tp_rank, tp_size=s.tp_size, shape=s.dims.shape,
            mesh_names=s.mesh.mesh_dim_names, device=str(s.device),
        )


def fsdp_units(config: dict, kind: str) -> int:
    """How many FSDP units smp.transform made (0: FSDP skipped)."""
    from torch.distributed.fsdp import FSDPModule

    with smp.session(config):
        model = smp.transform(build(kind))
        return sum(isinstance(m, FSDPModule) for m in model.modules())


def blocks_gathered_after_forward(config: dict, kind: str) -> list[bool]:
    """Per FSDP block unit: whether its parameters are still gathered after a forward."""
    from torch.distributed.fsdp import FSDPModule

    with smp.session(config):
        model = smp.transform(build(kind))
        loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, 128, seed=7)))
        blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        return [not isinstance(next(b.parameters()), DTensor) for b in blocks]


def clip_equivalence(config: dict) -> tuple[float, float]:
    """smp.clip_grad_norm_ on the sharded model vs torch's on the unsharded one."""
    with smp.session(config):
        torch.manual_seed(0)
        reference = build("plain")
        model = smp.transform(copy.deepcopy(reference))
        batch = random_batch(GLOBAL_BATCH, SEQ, 128, seed=7)
        loss_of(model, local_rows(batch)).backward()
        loss_of(reference, batch).backward()
        norm = smp.clip_grad_norm_(model, 0.01)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        return abs(float(norm) - float(ref_norm)), max_grad_diff(model, reference)


def accumulation_equivalence(config: dict) -> float:
    """Two micro-batches under smp.no_sync + one synced == one step on the whole batch."""
    with smp.session(config):
        torch.manual_seed(0)
        reference = build("plain")
        model = smp.transform(copy.deepcopy(reference))
        batch = random_batch(GLOBAL_BATCH, SEQ, 128, seed=9)
        local = local_rows(batch)
        half = local.shape[0] // 2
        with smp.no_sync(model):
            (loss_of(model, local[:half]) / 2).backward()
        (loss_of(model, local[half:]) / 2).backward()
        loss_of(reference, batch).backward()
        return max_grad_diff(model, reference)


def shard_bytes(config: dict, kind: str) -> tuple[int, int]:
    """(this rank's parameter bytes, the full model's parameter bytes)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = build(kind)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        model = smp.transform(model)
        local = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        return local, full


def init_error(config: dict) -> str:
    """The error smp.init raises for `config` on this world (collectives must not run)."""
    try:
        with smp.session(config):
            return ""
    except smp.ConfigError as e:
        return str(e)


def reinit_behaviour() -> list[str]:
    """Same config twice is a no-op; a different one is an error until shutdown."""
    events = []
    first = smp.init({"random_seed": 3})
    events.append("same" if smp.init({"random_seed": 3}) is first else "new")
    try:
        smp.init({"random_seed": 4})
    except smp.ConfigError as e:
        events.append(str(e))
    smp.shutdown()
    smp.init({"random_seed": 4})
    events.append(f"seed={smp.state.config.random_seed}")
    smp.shutdown()
    return events


def transform_error(config: dict, kind: str, meta: bool = False) -> str:
    with smp.session(config):
        try:
            if meta:
                with torch.device("meta"):
                    model = build(kind) if kind != "no_reset" else _NoReset()
            else:
                model = build(kind)
            smp.transform(model)
            return ""
        except (smp.ConfigError, ValueError) as e:
            return f"{type(e).__name__}: {e}"


class _NoReset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.layers[0](x) * self.scale
