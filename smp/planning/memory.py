"""Per-rank bytes of a model as `smp.transform` placed it, read from FSDP2's own shards
(padding included), and the optimizer-state and gathered-parameter bytes that follow from them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from smp._compat import fsdp_sharded_data, fsdp_unit_params
from smp.config import canonical_dtype

GiB = 1024**3

# Optimizer state per parameter element, in units of the parameter's own size.
OPTIMIZER_STATE_FACTOR = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:10.3f} {unit}"
    return f"{n:10.0f} B  "


def dtype_bytes(name: str | None, default: torch.dtype) -> int:
    """Bytes per element of the config dtype `name` (e.g. mixed_precision.param_dtype), or of
    `default` when the config leaves it unset."""
    if name is None:
        return torch.empty((), dtype=default).element_size() if default != torch.bool else 1
    return torch.empty((), dtype=getattr(torch, canonical_dtype(name)), device="meta").element_size()


def fsdp_units(model: nn.Module) -> list[tuple[nn.Module, list[Any]]]:
    """(module, its FSDPParams) for every FSDP unit of a transformed model."""
    from torch.distributed.fsdp import FSDPModule

    units, seen = [], set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            params = fsdp_unit_params(module)
            # A merged unit (fully_shard of several blocks) is one unit: listed at its first module.
            if params is not None and id(params[0]) not in seen:
                seen.add(id(params[0]))
                units.append((module, params))
    return units


def sharded_bytes(model: nn.Module) -> dict[str, int]:
    """Per-rank bytes of a transformed model's sharded parameters: "padded" (what FSDP allocates
    for parameters and gradients) and "local" (the unpadded shards, which optimizer state copies)."""
    padded = local = count = 0
    for _, params in fsdp_units(model):
        for fp in params:
            data = fsdp_sharded_data(fp)
            elem = data.element_size()
            padded += data.numel() * elem
            local += math.prod(fp.sharded_size) * elem
            count += 1
    return {"padded": padded, "local": local, "count": count}


def optimizer_state_bytes(optimizer: str, sharded: dict[str, int]) -> int:
    """Per-rank optimizer state for `sharded` (a `sharded_bytes` result)."""
    state = OPTIMIZER_STATE_FACTOR[optimizer] * sharded["local"]
    if optimizer.startswith("adam"):
        state += 4 * sharded["count"]  # each parameter's step counter: a float32 scalar
    return state


def transient_bytes(model: nn.Module, param_bytes: int, grad_bytes: int, *, all_gathered: bool = False) -> int:
    """Gathered parameters and unsharded gradients alive at once during a step, per rank.

    The root stays gathered for the whole step (reshard_after_forward=False, sharding/fsdp.py);
    two blocks are gathered at once (the one computing and the one prefetched); one unit's
    unsharded gradient waits for its reduce-scatter. `all_gathered`: every unit stays gathered
    through the step (reshard_after_forward=False for the blocks too, smp's default under pp).
    """
    root = block = total = 0  # unsharded (padded) elements of the root unit, the largest block, all units
    for module, params in fsdp_units(model):
        elems = sum(fsdp_sharded_data(fp).numel() for fp in params) * params[0].mesh_info.shard_mesh_size
        total += elems
        if module is model:
            root = elems
        else:
            block = max(block, elems)
    gathered = total if all_gathered else root + 2 * block
    return gathered * param_bytes + max(root, block) * grad_bytes
