"""Which modules become FSDP units (and activation-checkpointing units): the transformer blocks,
as the model's anatomy (smp/anatomy.py) names them."""

from __future__ import annotations

from torch import nn

from smp.anatomy import Anatomy, describe


def find_blocks(model: nn.Module, class_names: list[str] | None = None,
                anatomy: Anatomy | None = None) -> list[nn.Module]:
    """The model's repeated blocks, outermost first, in module order (`Anatomy.blocks`: the
    classes named in `class_names` (the config's `shard_modules`), else the model's own).
    `anatomy`: the picture the recipe already took of `model`, read instead of walking it again."""
    picture = anatomy if anatomy is not None and not class_names else describe(model, class_names)
    return picture.block_modules(model)


def root_modules(model: nn.Module, blocks: list[nn.Module]) -> tuple[list[str], float]:
    """(the modules whose parameters stay in the root FSDP unit, outside every block, in model
    order; their share of the model's parameters): what `smp plan` reports as always gathered."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    names: list[str] = []
    root = total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if id(p) not in in_blocks:
            root += p.numel()
            module = name.rpartition(".")[0] or "<root>"
            if module not in names:
                names.append(module)
    return names, (root / total if total else 0.0)
