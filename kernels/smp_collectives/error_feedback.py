"""Error feedback: the part of each gradient that quantisation dropped, added back next step.

One `Residual` per collective instance (FSDP2 installs one comm per module, so state is per
module). Over steps the transmitted values telescope:

    sum_t dequant_t = sum_t grad_t + residual_0 - residual_T

so no gradient mass is lost, only delayed; this is what keeps int8/fp8 training on the
fp32-sync loss curve (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD").
"""

from __future__ import annotations

import torch


class Residual:
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The fp32 residual of `shape` (zeros the first time, or when the shape changes)."""
        if self.buffer is None or self.buffer.shape != torch.Size(shape) or self.buffer.device != device:
            self.buffer = torch.zeros(shape, dtype=torch.float32, device=device)
        return self.buffer

    def reset(self) -> None:
        self.buffer = None
