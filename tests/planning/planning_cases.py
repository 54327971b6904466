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


# ----------------------------------------------------------------------------------------------
# Pipeline parallelism: what a real schedule sends and holds


class P2PCounter:
    """Counts the bytes torch's pipeline stages hand to `dist.isend` through `dist.P2POp` (every
    activation and gradient a PipelineStage sends is built as one)."""

    def __init__(self):
        self.sent = 0

    def __enter__(self):
        import torch.distributed as dist

        self.original = dist.P2POp
        counter = self

        class Counted(self.original):
            def __init__(self, op, tensor, *args, **kwargs):
                super().__init__(op, tensor, *args, **kwargs)
                if op is dist.isend:
                    counter.sent += tensor.numel() * tensor.element_size()

        dist.P2POp = Counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.P2POp = self.original


class LiveSavedBytes:
    """The peak bytes of the tensors autograd holds for backward (each storage once, parameters
    left out), over everything run inside: a saved tensor counts from the forward that saves it
    until autograd frees it (after its backward)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.current = self.peak = 0

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or t.device.type == "meta":
            return t
        if ptr not in self.refs:
            self.refs[ptr], self.sizes[ptr] = 0, storage.nbytes()
            self.current += self.sizes[ptr]
            self.peak = max(self.peak, self.current)
        self.refs[ptr] += 1
        return _Held(self, ptr, t)

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.current -= self.sizes.pop(ptr)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor if isinstance(h, _Held) else h)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class _Held:
    def __init__(self, owner: LiveSavedBytes, ptr: int, tensor: torch.Tensor):
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self):
        self.owner._release(self.ptr)


def pipeline_measured(configs: list[dict], layers: int = 4, batch: int = 8, seq_len: int = 16) -> list[dict]:
    """For each config (pipeline_parallel_degree > 1): build the tiny Llama under it, run one
    warm-up step (torch infers the stage shapes on the first), then one counted step: the bytes
    this rank's stages send, the peak saved-activation bytes, and the parameter, gradient and
    AdamW-state bytes this rank holds."""
    import smp.pipeline

    out = []
    for config in configs:
        with smp.session(config):
            torch.manual_seed(0)
            model = smp.transform(tiny_llama(num_hidden_layers=layers))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ids = random_batch(batch, seq_len, 256, seed=0)
            smp.pipeline.step(model, ids)
            opt.zero_grad()
            with P2PCounter() as sent, LiveSavedBytes(model) as saved:
                smp.pipeline.step(model, ids)
            grads = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
            opt.step()
            states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            out.append({"sent": sent.sent, "saved_peak": saved.peak, "params": storage_bytes(model.parameters()),
                        "grads": grads, "optimizer": storage_bytes(states)})
    return out
