"""What a device can do and what a run used of it: the dense bf16 peak FLOP/s by device name
(`PEAK_FLOPS`: MFU is left blank on a device not in it, never guessed) and this rank's peak
memory; `gather_per_rank` collects a per-rank figure on every rank."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

from smp.mesh import device_type_for


# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' datasheets.
# Matched in order against torch.cuda.get_device_name(): put specific names before general ones.
PEAK_FLOPS: list[tuple[tuple[str, ...], float]] = [
    (("H100", "PCIE"), 756e12),
    (("H100", "NVL"), 835e12),
    (("GH200",), 989e12),
    (("H200",), 989e12),
    (("H100",), 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    (("B200",), 2250e12),
    (("A100",), 312e12),
    (("L40S",), 362e12),
    (("L4",), 121e12),
    (("MI300X",), 1307e12),
]


def peak_flops(device_name: str | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when it is not known (CPUs, unlisted GPUs)."""
    if not device_name:
        return None
    upper = device_name.upper()
    for words, flops in PEAK_FLOPS:
        if all(w in upper for w in words):
            return flops
    return None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def peak_memory_bytes(device: torch.device | str) -> dict[str, int]:
    """This rank's peak memory: the CUDA allocator's active and reserved peaks on a GPU; on a
    CPU the process's peak resident set (the only honest figure the host allocator gives)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {
            "peak_active": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device)),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return {"peak_rss": int(rss if sys.platform == "darwin" else rss * 1024)}


def gather_per_rank(value: float, device: torch.device | str | None = None) -> list[float]:
    """Every rank's value of a scalar, on every rank (rank order). `device` defaults to where
    the default group runs collectives: an NCCL group has no CPU backend, so the current CUDA
    device (the one smp.init set); else the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(value)]
    if device is None:
        device = device_type_for(dist.get_backend())
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]
