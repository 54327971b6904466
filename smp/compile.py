"""torch.compile, one block at a time (the config's `compile`).

Each block is compiled in place with `module.compile()`: the module tree, parameter names and
state-dict keys stay as the user wrote them (no `_orig_mod.` prefix), so checkpoints load with
or without compile. Per block, not the whole model, as torchtitan does: the blocks of a
transformer share one forward, so one graph serves them all (compile time does not grow with
depth), and FSDP's hooks around each block stay outside the compiled region. It runs after
tensor parallel and activation checkpointing (the compiled forward includes the checkpointed
one) and before FSDP (whose hooks then wrap the compiled block).
"""

from __future__ import annotations

from torch import nn

from smp.errors import ConfigError


def apply_compile(model: nn.Module, blocks: list[nn.Module], backend: str) -> list[nn.Module]:
    """Compile each of `blocks` in place with torch.compile's `backend` ("inductor" on GPUs;
    "aot_eager" traces the same graphs without generating code, for CPU tests). Returns `blocks`."""
    if not blocks:
        raise ConfigError(
            f"compile found no blocks to compile in {type(model).__name__}; "
            "name the block class in shard_modules"
        )
    for block in blocks:
        block.compile(backend=backend)
    return blocks
