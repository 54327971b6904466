"""Which modules become FSDP units (and activation-checkpointing units): the transformer blocks."""

from __future__ import annotations

from torch import nn

from smp.config import ConfigError


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The model's repeated blocks, outermost first, in module order.

    In order of preference: the classes named in the config (`shard_modules`), a Hugging Face
    model's `_no_split_modules`, else the children of the model's nn.ModuleLists.
    """
    if class_names:
        wanted = set(class_names)
        blocks = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        found = {type(m).__name__ for m in blocks}
        missing = sorted(wanted - found)
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"shard_modules names {missing}, which the model does not contain; "
                f"its module classes are: {', '.join(present)}"
            )
        return _outermost(blocks)

    no_split = getattr(model, "_no_split_modules", None)
    if no_split:
        blocks = [m for m in model.modules() if type(m).__name__ in set(no_split) and m is not model]
        if blocks:
            return _outermost(blocks)

    blocks = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    return _outermost(blocks)


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested inside other blocks: FSDP units must not overlap in parameters twice."""
    inner = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    return [b for b in blocks if id(b) not in inner]
