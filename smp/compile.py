"""torch.compile, one block at a time (the config's `compile`), optionally replayed as CUDA graphs.

Each block is compiled in place with `module.compile()`: the module tree, parameter names and
state-dict keys stay as the user wrote them (no `_orig_mod.` prefix), so checkpoints load with
or without compile. Per block, not the whole model, as torchtitan does: the blocks of a
transformer share one forward, so one graph serves them all (compile time does not grow with
depth), and FSDP's hooks around each block stay outside the compiled region. It runs after
tensor parallel and activation checkpointing (the compiled forward includes the checkpointed
one) and before FSDP (whose hooks then wrap the compiled block).

`compile.cuda_graphs` adds torch's cudagraph trees (inductor's mode="reduce-overhead"): each
block's compiled forward and backward are recorded once per shape and replayed, so the host
launches one graph where it launched every kernel. Torch owns the mechanics (static inputs,
re-recording, the graphs' memory pool, its errors when a graph's output is read after the next
replay overwrote it); smp decides where it may run: CUDA (`check_cuda_graphs`, at `smp.init`),
and a layout smp/composition.py allows (`check_cuda_graph_layout`, inside `smp.transform`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp import composition
from smp.errors import ConfigError


def compile_options(backend: str, cuda_graphs: bool) -> dict[str, Any]:
    """The keyword arguments of each block's `module.compile()`.

    With CUDA graphs: inductor's "reduce-overhead" mode, and torch's "cudagraphs" backend in
    place of aot_eager (the same graphs, replayed). `dynamic=False`: a new shape compiles and
    records graphs of its own instead of a symbolic-shape graph re-recorded per size."""
    if not cuda_graphs:
        return {"backend": backend}
    if backend == "inductor":
        return {"backend": "inductor", "mode": "reduce-overhead", "dynamic": False}
    if backend in ("aot_eager", "cudagraphs"):
        return {"backend": "cudagraphs", "dynamic": False}
    raise ConfigError(f"compile.cuda_graphs needs backend inductor or aot_eager, got {backend!r}")


def apply_compile(model: nn.Module, blocks: list[nn.Module], backend: str, *, cuda_graphs: bool = False) -> list[nn.Module]:
    """Compile each of `blocks` in place with torch.compile's `backend` ("inductor" on GPUs;
    "aot_eager" traces the same graphs without generating code, for CPU tests), replayed as CUDA
    graphs when `cuda_graphs`. Returns `blocks`."""
    if not blocks:
        raise ConfigError(
            f"compile found no blocks to compile in {type(model).__name__}; "
            "name the block class in shard_modules"
        )
    options = compile_options(backend, cuda_graphs)
    for block in blocks:
        block.compile(**options)
    return blocks


def check_cuda_graphs(cuda_graphs: bool, device: torch.device) -> None:
    """ConfigError unless this run's device can replay CUDA graphs (called by `smp.init`, on
    every rank, before the process group exists)."""
    if not cuda_graphs:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"compile.cuda_graphs: true needs a CUDA device (CUDA graphs); this run is on {device.type}: "
            "set compile.cuda_graphs: false (compile: true still compiles the blocks)"
        )
    if torch.version.hip is not None:
        raise ConfigError(
            f"compile.cuda_graphs: true is proven on NVIDIA CUDA only; this is ROCm (HIP {torch.version.hip}): "
            "set compile.cuda_graphs: false"
        )


def check_cuda_graph_layout(config: Any, model: nn.Module, experts: tuple[str, ...]) -> None:
    """ConfigError where `model`, as smp.transform laid it out, cannot replay CUDA graphs: FSDP
    units built (at world 1 too, for some models and settings) or mixture-of-experts layers
    (`experts`: the anatomy's). The decision and its message are smp/composition.py's."""
    from torch.distributed.fsdp import FSDPModule

    found = ("experts",) if experts else ()
    found += ("fsdp_units",) if any(isinstance(m, FSDPModule) for m in model.modules()) else ()
    composition.check_run(config, found)
