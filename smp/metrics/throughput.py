"""Tokens/s, TFLOP/s and MFU per device for one step."""

from __future__ import annotations

from dataclasses import dataclass

from smp.metrics.flops import mfu


@dataclass
class ThroughputMeter:
    """Tokens/s, TFLOP/s and MFU per device for one step."""

    flops_per_token: float
    world_size: int
    peak: float | None  # FLOP/s of one device, None when unknown

    def step(self, tokens_global: int, seconds: float) -> dict[str, float | None]:
        tokens_per_s = tokens_global / seconds if seconds > 0 else 0.0
        per_device = tokens_per_s / self.world_size
        achieved = per_device * self.flops_per_token
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "tflops_per_device": achieved / 1e12,
            "mfu": mfu(achieved, self.peak),
        }
