"""Rank-side cases for test_planning_moe: a real expert-parallel training step whose per-rank
bytes and all-to-all traffic `smp plan` predicts."""

from __future__ import annotations

import torch
import torch.distributed as dist

import smp
import smp.expert_parallel.dispatch as dispatch_module
from smp.expert_parallel import is_expert_parallel
from smp.testing.distributed import local_tensor
from smp.testing.models import random_batch
from tests.expert_parallel.expert_parallel_cases import EXPERTS, VOCAB, build
from tests.planning.planning_cases import storage_bytes


def _route(routing: str, ep_rank: int, ep: int):
    """A forward pre-hook on an experts module that replaces the router's choices (weights kept).
    balanced: token t's j-th choice is expert (t x top_k + j) mod E, so every expert, hence every
    ep rank, gets the same number of choices (the plan's assumption). local: every token picks
    experts of its own ep rank, so nothing needs to travel."""

    def hook(module, args):
        hidden, index, weights = args
        tokens, top_k = index.shape
        choice = torch.arange(tokens * top_k, device=index.device).view(tokens, top_k)
        if routing == "balanced":
            return hidden, choice % EXPERTS, weights
        per_rank = EXPERTS // ep
        return hidden, ep_rank * per_rank + choice % top_k % per_rank, weights

    return hook


class ExchangeCounter:
    """Bytes smp's dispatch sends to other ranks: forward, counted when a row exchange runs, and
    backward, counted when the gradient of the exchange's output arrives (that gradient is what
    the backward all-to-all sends), so a backward that never runs counts nothing."""

    def __init__(self) -> None:
        self.original = dispatch_module._exchange
        self.forward = self.backward = 0

    def __call__(self, t, output_splits, input_splits, group):
        rank = dist.get_rank(group)
        row = t.shape[-1] * t.element_size()
        self.forward += (sum(input_splits) - input_splits[rank]) * row
        out = self.original(t, output_splits, input_splits, group)

        def on_gradient(grad: torch.Tensor) -> None:
            self.backward += (sum(output_splits) - output_splits[rank]) * grad.shape[-1] * grad.element_size()

        out.register_hook(on_gradient)
        return out


def measured_expert_step(config: dict, kind: str, routing: str, seq_len: int = 16, batch: int = 2) -> dict:
    """One AdamW step of a tiny MoE model under `config` with the given routing; this rank's
    parameter, gradient and optimizer-state bytes (distinct storages, FSDP padding included), its
    expert parameters, and the all-to-all bytes it sent forward and backward."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build(kind))
        experts = [m for m in model.modules() if is_expert_parallel(m)]
        for module in experts:
            module.register_forward_pre_hook(_route(routing, smp.state.ep_rank, smp.state.dims.ep))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = random_batch(batch, seq_len, VOCAB, seed=smp.state.rank)
        counter = ExchangeCounter()
        dispatch_module._exchange = counter
        try:
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            dispatch_module._exchange = counter.original
        grads = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        expert_params = [p for m in experts for p in m.parameters(recurse=False)]
        return {
            "params": storage_bytes(model.parameters()), "grads": grads, "optimizer": storage_bytes(states),
            "expert_total": sum(p.numel() for p in expert_params),
            "expert_local": sum(local_tensor(p).numel() for p in expert_params),
            "expert_param_bytes": storage_bytes(expert_params),
            "a2a_forward": counter.forward, "a2a_backward": counter.backward,
        }
