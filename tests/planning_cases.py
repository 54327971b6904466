"""Rank-side cases for test_planning: a real multi-rank run whose per-rank bytes the plan predicts."""

from __future__ import annotations

import torch

import smp
from smp.testing.distributed import local_tensor
from smp.testing.models import random_batch, tiny_llama


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = local_tensor(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def forward_saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes autograd saves in one real forward of `model` (a causal LM) on `ids`, each storage
    once, parameters left out: what the plan's activation estimate predicts."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss
    return sum(saved.values())


def measured_bytes(config: dict, seq_len: int = 16, batch: int = 2) -> dict[str, int]:
    """Train the tiny Llama one AdamW step under `config`; this rank's parameter, gradient and
    optimizer-state bytes as allocated (distinct storages, FSDP padding included)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_llama())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = random_batch(batch, seq_len, 256, seed=smp.state.rank)
        smp.gradient_sync_bytes(reset=True)
        model(input_ids=ids, labels=ids).loss.backward()
        sync = smp.gradient_sync_bytes(reset=True)  # per collective, counted by smp_collectives
        grads = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        params = storage_bytes(model.parameters())
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "grads": grads, "optimizer": storage_bytes(states), "sync": sync}
