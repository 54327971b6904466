"""Which modules become FSDP units (and activation-checkpointing units): the transformer blocks."""

from __future__ import annotations

import logging
import warnings

from torch import nn

from smp._compat import no_split_modules, own_parameters
from smp.config import ConfigError
from smp.errors import SMPWarning

log = logging.getLogger(__name__)


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The model's repeated blocks, outermost first, in module order.

    In order of preference: the classes named in the config (`shard_modules`), a Hugging Face
    model's `_no_split_modules` (each promoted to the repeated layer holding it: the nn.ModuleList
    element it sits in), else the children of the model's nn.ModuleLists. A block that
    shares a parameter (a tied weight) with another block or with the rest of the model is
    left to the root unit: FSDP2 manages each parameter in exactly one unit.
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
        return _without_shared_parameters(model, _outermost(blocks), named_by_user=True)

    no_split = no_split_modules(model)
    if no_split:
        blocks = [m for m in model.modules() if type(m).__name__ in set(no_split) and m is not model]
        if blocks:
            return _without_shared_parameters(model, _outermost(_repeated_layers(model, blocks)))

    # A list of lists (PVT's stages of layers): the inner lists have no forward of their own,
    # which fully_shard refuses; their elements are the blocks.
    containers = (nn.ModuleList, nn.ModuleDict)
    blocks = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m
              if not isinstance(child, containers)]
    return _without_shared_parameters(model, _outermost(blocks))


def _repeated_layers(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Each block replaced by the repeated layer that holds it: the nearest enclosing module
    (itself included) that is an element of an nn.ModuleList. `_no_split_modules` sometimes
    names only a part of a layer (Idefics3 and SmolVLM list their vision *attention*), which
    would leave the rest of every layer (MLPs, norms) in the always-gathered root unit."""
    parent: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    layers = []
    for block in blocks:
        current, layer = block, block
        while id(current) in parent:
            if isinstance(parent[id(current)], nn.ModuleList):
                layer = current
                break
            current = parent[id(current)]
        layers.append(layer)
    return layers


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


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """Drop blocks nested inside other blocks: FSDP units must not overlap in parameters twice."""
    inner = {id(sub) for b in blocks for sub in b.modules() if sub is not b}
    unique, seen = [], set()
    for b in blocks:
        if id(b) not in inner and id(b) not in seen:  # one module listed twice is one unit
            unique.append(b)
            seen.add(id(b))
    return unique


def _without_shared_parameters(
    model: nn.Module, blocks: list[nn.Module], named_by_user: bool = False
) -> list[nn.Module]:
    """`blocks` less those holding a parameter that another unit (another block, or the root:
    everything outside the blocks) also uses, e.g. BERT's word embeddings tied to the MLM decoder.

    Those parameters then all live in the root unit, with every module that uses them. Decided
    from the module tree only (parameter identity), so it holds for any model, on meta too.
    """
    unit_of_module: dict[int, int] = {}  # id(module) -> block index; absent: the root
    for index, block in enumerate(blocks):
        for sub in block.modules():
            unit_of_module[id(sub)] = index
    units_of_param: dict[int, set[int]] = {}
    names_of_param: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        unit = unit_of_module.get(id(module), -1)
        for name, param in own_parameters(module).items():
            if param is None:
                continue
            units_of_param.setdefault(id(param), set()).add(unit)
            names_of_param.setdefault(id(param), []).append(f"{module_name}.{name}" if module_name else name)
    dropped: dict[int, list[str]] = {}
    for pid, units in units_of_param.items():
        if len(units) > 1:
            for unit in units - {-1}:
                dropped.setdefault(unit, []).extend(names_of_param[pid])
    if not dropped:
        return blocks
    for index in sorted(dropped):
        message = (
            f"smp: {type(blocks[index]).__name__} block #{index} shares parameters with another part "
            f"of the model ({', '.join(sorted(set(dropped[index])))}); it stays in the root FSDP "
            "unit with them, not in a unit of its own"
        )
        if named_by_user:
            warnings.warn(message, SMPWarning, stacklevel=3)
        else:
            log.info(message)
    return [b for index, b in enumerate(blocks) if index not in dropped]
