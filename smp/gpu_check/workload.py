"""The training workload the CUDA timing steps share: a Llama-shaped model sized to the GPU,
its batch, one bf16-autocast training step, and whether the device has the memory for it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from smp.models import build_causal_lm, resolve_model_config


@dataclass(frozen=True)
class Workload:
    shape: str  # a smp.models.MODEL_SHAPES name
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


WORKLOADS = {
    "1b": Workload("llama-1b", batch=2, seq=2048),  # ~1.2B parameters (Llama 3.2 1B shape)
    "tiny": Workload("tiny", batch=4, seq=256),
}


def build_model(workload: Workload, device: torch.device) -> torch.nn.Module:
    """fp32 parameters, SDPA attention, built on `device`."""
    config = resolve_model_config(workload.shape, use_cache=False)
    with torch.device(device):
        return build_causal_lm(config)


def batch(workload: Workload, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (workload.batch, workload.seq), generator=g).to(device)


def forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """The step's bf16 autocast forward and its backward."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One step as a user writes it: bf16 autocast forward, backward, optimizer step."""
    forward_backward(model, ids)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, steps: int) -> list[float]:
    """Wall seconds of each of `steps` training steps, the device synchronised around each."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, optimizer, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def bytes_needed(params: int, workload: Workload, models: int, vocab: int, layers: int, hidden: int) -> int:
    """A generous estimate of peak device memory: per model fp32 parameters, gradients and
    AdamW state (16 B / parameter), plus one step's activations without checkpointing
    (~40 B per token per layer per hidden unit in bf16, and the fp32 logits and their grad)."""
    states = 16 * params * models
    activations = workload.tokens * layers * hidden * 40 + workload.tokens * vocab * 12
    return states + activations


def memory_shortfall(needed: int, device: torch.device) -> str | None:
    """Why the device cannot hold `needed` bytes, or None when it can."""
    free, total = torch.cuda.mem_get_info(device)
    if needed > free:
        return (f"too little GPU memory: needs ~{needed / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free of "
                f"{total / 2**30:.0f} GiB; run with --size tiny")
    return None


def build_if_it_fits(workload: Workload, device: torch.device) -> tuple[torch.nn.Module | None, int, str | None]:
    """The plain model of `workload`, its parameter count and None; or (None, its parameter
    count, why) when the device lacks the memory a step of two such models needs."""
    model = build_model(workload, device)
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    shortfall = memory_shortfall(
        bytes_needed(params, workload, 2, cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size), device)
    if shortfall:
        del model
        torch.cuda.empty_cache()
        return None, params, shortfall
    return model, params, None
