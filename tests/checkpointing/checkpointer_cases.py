"""Checkpointer cases that run on every rank of a RankPool: a run under `Checkpointer` saved
midway, then resumed into a fresh model, optimizer, scheduler and data cursor, against the
same run uninterrupted."""

from __future__ import annotations

import os

import torch

import smp
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import TinyTransformer, loss_of, random_batch

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 128


class Cursor:
    """A data position with state_dict / load_state_dict, as a stateful data loader has."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> torch.Tensor:
        self.position += 1
        return random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=2000 + self.position)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _parts(seed: int):
    torch.manual_seed(seed)
    model = smp.transform(TinyTransformer(vocab=VOCAB, dim=32, hidden=64, layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))  # lr changes every step
    return model, opt, sched, Cursor()


def _step(model, opt, sched, data) -> float:
    loss = loss_of(model, local_rows(data.next_batch()))
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return world_mean(loss)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def resume_under_checkpointer(root: str, steps: int, every: int, drop_scheduler: bool = False) -> dict:
    """`steps` steps under a Checkpointer saving every `every` (async, keep_last=2), then a fresh
    model (other weights), optimizer, scheduler and cursor resumed from it and run to `steps`.
    `drop_scheduler`: the resume is not given the scheduler (must be caught)."""
    with smp.session({}):
        model, opt, sched, data = _parts(0)
        ckpt = smp.checkpointing.Checkpointer(root, model, opt, scheduler=sched, data=data, every=every,
                                              keep_last=2, async_save=True)
        start = ckpt.resume()  # nothing there yet
        losses, lrs = [], []
        for step in range(start, steps):
            losses.append(_step(model, opt, sched, data))
            lrs.append(opt.param_groups[0]["lr"])
            ckpt.maybe_save(step + 1)
        ckpt.wait()
        final = _params(model)

        fresh, fresh_opt, fresh_sched, fresh_data = _parts(99)
        stateful = {"data": fresh_data} if drop_scheduler else {"scheduler": fresh_sched, "data": fresh_data}
        resumed_at = smp.checkpointing.Checkpointer(root, fresh, fresh_opt, **stateful).resume()
        epoch_after_resume = fresh_sched.last_epoch
        resumed, resumed_lrs = [], []
        for _ in range(resumed_at, steps):
            resumed.append(_step(fresh, fresh_opt, fresh_sched, fresh_data))
            resumed_lrs.append(fresh_opt.param_groups[0]["lr"])
        diff = max(float((final[k] - v).abs().max()) for k, v in _params(fresh).items())
        return {
            "first_start": start, "resumed_at": resumed_at, "losses": losses, "resumed": resumed,
            "param_diff": diff, "lrs": lrs, "resumed_lrs": resumed_lrs, "scheduler_epoch": epoch_after_resume,
            "cursor": fresh_data.position, "folders": sorted(n for n in os.listdir(root) if not n.startswith(".")),
        }
