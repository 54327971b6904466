"""Rank-pool cases for tests/reliability/test_reliability.py (importable by the pool's workers)."""

from __future__ import annotations

import contextlib

import warnings

import torch
import torch.distributed as dist

import smp
from smp.testing.models import TinyTransformer


def _fsdp_model_with_grads():
    model = smp.transform(TinyTransformer(vocab=64, dim=32, hidden=64, layers=2))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, labels=ids).backward()
    return model


def nonfinite_on_one_rank(bad_rank: int, param_name: str, action: str, guarded: bool = False):
    """NaN in the local shard of `param_name` on `bad_rank` only; every rank must agree.

    `guarded`: inside smp.step_guard, which must let the agreed error through on every rank
    (no rank blamed, none stopped)."""
    with smp.session({"backend": "gloo", "random_seed": 0}):
        model = _fsdp_model_with_grads()
        assert smp.check_finite_grads(model, step=0, action=action)  # clean grads pass
        params = dict(model.named_parameters())
        before = {n: p.detach().to_local().clone() for n, p in params.items()}
        if dist.get_rank() == bad_rank:
            local = params[param_name].grad.to_local()
            assert local.numel() > 0, "the chosen parameter has no shard on the bad rank"
            local.view(-1)[0] = float("nan")
        result: dict = {}
        try:
            with warnings.catch_warnings(record=True) as caught, (
                smp.step_guard(7) if guarded else contextlib.nullcontext()
            ):
                warnings.simplefilter("always")
                result["ok"] = smp.check_finite_grads(model, step=7, action=action)
            result["warnings"] = [str(w.message) for w in caught]
        except smp.NonFiniteGradientError as e:
            result["error"] = str(e)
            result["parameters"] = e.parameters
            result["modules"] = e.modules
        if action == "skip":
            result["grads_dropped"] = all(p.grad is None for p in model.parameters())
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            opt.step()
            result["unchanged"] = all(
                torch.equal(before[n], p.detach().to_local()) for n, p in model.named_parameters()
            )
        return result


def mesh_group_timeouts(config: dict):
    """Timeout (s) of every mesh group on this rank, and whether each one is the default group."""
    from smp.reliability.timeouts import group_timeouts

    with smp.session(config):
        st = smp.state
        default = dist.distributed_c10d._get_default_group()
        out = {}
        for mesh in (st.mesh, st.dp_mesh):
            timeouts = group_timeouts(mesh)
            for dim, name in enumerate(mesh.mesh_dim_names):
                out[name] = (timeouts[name], mesh.get_group(dim) is default)
        return out


def run_ids_per_rank(ids: dict, save_dir: str | None = None) -> dict:
    """smp.init (or, with `save_dir`, a first save under plain torch.distributed) with this rank's
    SMP_RUN_ID from `ids` ({rank: id}; a rank not in it has none): the error it raised, and how
    long until it did."""
    import os
    import time

    from smp.checkpointing.commit import run

    rank = dist.get_rank()
    saved = {k: os.environ.pop(k, None) for k in (run.RUN_ID_ENV, run.TORCHRUN_RUN_ID_ENV)}
    if str(rank) in ids:
        os.environ[run.RUN_ID_ENV] = ids[str(rank)]
    start = time.monotonic()
    try:
        if save_dir is None:
            with smp.session({"backend": "gloo"}):
                pass
        else:
            from smp.scope import isolated

            with isolated("run id case"):  # a fresh run id slot, as in a new process
                smp.checkpointing.save(os.path.join(save_dir, "step_1"), torch.nn.Linear(2, 2))
        return {"error": None, "seconds": time.monotonic() - start}
    except smp.Error as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
