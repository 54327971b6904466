"""torchao's private names smp reaches (checked on torchao 0.18.0)."""

from __future__ import annotations

import sys

import torch

# ----------------------------------------------------------------------------------------------
# torchao (checked 0.18.0)
# ----------------------------------------------------------------------------------------------


def float8_castable_weight(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor inside torchao's `WeightWithDynamicFloat8CastTensor` (the weight class of
    `enable_fsdp_float8_all_gather`; its data is the attribute `_tensor`, same storage), or None
    when `t` is not one. torchao not imported: no weight can be one (nothing is imported here)."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    wrapper = getattr(fsdp_utils, "WeightWithDynamicFloat8CastTensor", None)
    return t._tensor if wrapper is not None and isinstance(t, wrapper) else None
