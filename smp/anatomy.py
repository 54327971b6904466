"""One picture of a model's parts, found once per transform and handed to every step.

`describe(model)` walks the module tree once and names what the recipe's steps need: the
repeated blocks (FSDP and activation-checkpointing units), the pipeline split's parts (the layer
list, what only the first / last stage keeps), the input embedding, the output head, the decoder
transformers names, norms, attention / MLP / experts modules, vision and audio towers, tied and
0-d parameters. Steps read this picture instead of finding "the layers" again: a second walk is
a second truth that drifts (two `is_norm` that disagreed is how that started).

Everything is held by qualified name (plain strings), so the picture stays true while the steps
wrap modules in place (TP turns parameters into DTensors, checkpointing adds hooks) and one
picture can be shown by `smp plan` without the model. Finding a part never raises: what smp
cannot find is recorded with the reason (`pipeline_refusal`), and the step that needs it raises.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from torch import nn

from smp._compat import no_split_modules, own_parameters
from smp.errors import ConfigError, SMPWarning

# torch's BatchNorm layers, which normalise with the statistics of the rows they see (SyncBatchNorm,
# which computes them over every rank's rows, is none of these)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
               nn.LazyBatchNorm3d)

log = logging.getLogger(__name__)

# Last components of a submodule's name that mark a vision or audio tower inside a multimodal model.
_TOWER_WORDS = ("vision", "visual", "audio", "image_tower", "speech_encoder")


@dataclass(frozen=True)
class PipelineParts:
    """Where a model's pipeline-relevant parts live, by attribute path from the model."""

    layers: str  # the nn.ModuleList of blocks, e.g. "model.layers"
    first: tuple[str, ...]  # modules only the first stage keeps (the embedding)
    last: tuple[str, ...]  # modules only the last stage keeps (final norm, head)
    hf: bool  # a transformers causal LM (run through its own forward) or a plain sequential model


@dataclass(frozen=True)
class Anatomy:
    """A model's parts by qualified name ("" is the model itself). See the module docstring."""

    model_class: str
    blocks: tuple[str, ...]  # the repeated layers, outermost first, in module order: one FSDP unit each
    pipeline: PipelineParts | None  # None: smp cannot split it (`pipeline_refusal` says why)
    pipeline_refusal: str | None
    embedding: str | None  # transformers' get_input_embeddings()
    head: str | None  # transformers' get_output_embeddings(): the LM head
    decoder: str | None  # transformers' get_decoder(): the language model of a multimodal one
    norms: tuple[str, ...]
    attention: tuple[str, ...]  # attention modules inside the blocks (outermost per block)
    mlp: tuple[str, ...]  # MLP / feed-forward modules inside the blocks (outermost per block)
    experts: tuple[str, ...]  # modules holding [num_experts, ...] parameters
    towers: tuple[str, ...]  # vision / audio sub-models of a multimodal model
    tied: tuple[tuple[str, ...], ...]  # parameter names sharing one tensor (first name = owner)
    scalars: tuple[str, ...]  # 0-d parameters (CLIP's logit_scale): fully_shard refuses them
    batch_norms: tuple[str, ...]

    def block_modules(self, model: nn.Module) -> list[nn.Module]:
        """The blocks as modules of `model` (the model this picture was taken of)."""
        return [model.get_submodule(n) for n in self.blocks]

    @property
    def final_norm(self) -> str | None:
        """The norm after the last layer: what the last stage keeps besides the head."""
        last = self.pipeline.last if self.pipeline else ()
        return next((n for n in last if n in self.norms), None)

    @property
    def layers(self) -> str | None:
        return self.pipeline.layers if self.pipeline else None

    def require_pipeline(self) -> PipelineParts:
        """The pipeline parts, or the ConfigError saying why smp cannot split this model."""
        if self.pipeline is None:
            raise ConfigError(self.pipeline_refusal or f"smp cannot split {self.model_class} into pipeline stages")
        return self.pipeline


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer over the hidden size: torch's LayerNorm / RMSNorm, or a family's own
    class named like them (LlamaRMSNorm, CohereLayerNorm, ...). The one test every step uses."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def describe(model: nn.Module, shard_modules: list[str] | None = None) -> Anatomy:
    """The parts of `model` (see the module docstring). `shard_modules` (the config's class names)
    overrides which modules are the blocks, as it overrides FSDP's units."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = _block_names(model, names, shard_modules)
    pipeline, refusal = _pipeline_parts(model)
    block_modules = [model.get_submodule(b) for b in blocks]
    return Anatomy(
        model_class=type(model).__name__,
        blocks=blocks,
        pipeline=pipeline,
        pipeline_refusal=refusal,
        embedding=_name_of(names, _called(model, "get_input_embeddings")),
        head=_name_of(names, _called(model, "get_output_embeddings")),
        decoder=_name_of(names, _called(model, "get_decoder")),
        norms=tuple(n for n, m in model.named_modules() if is_norm(m)),
        attention=_inside(block_modules, names, lambda m: "Attention" in type(m).__name__
                          or isinstance(m, nn.MultiheadAttention)),
        mlp=_inside(block_modules, names, lambda m: type(m).__name__.endswith(("MLP", "FeedForward", "FFN"))),
        experts=tuple(n for n, m in model.named_modules()
                      if getattr(m, "num_experts", None) and any(p.ndim == 3 for p in m.parameters(recurse=False))),
        towers=_outermost_names([n for n, m in model.named_modules()
                                 if n and n.rpartition(".")[2].startswith(_TOWER_WORDS) and _has_params(m)]),
        tied=_tied(model),
        scalars=tuple(n for n, p in model.named_parameters() if p.ndim == 0),
        batch_norms=tuple(n for n, m in model.named_modules() if isinstance(m, BATCH_NORMS)),
    )


def _called(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    try:
        found = get() if callable(get) else None
    except (NotImplementedError, AttributeError):  # a transformers model without that part
        return None
    return found if isinstance(found, nn.Module) else None


def _name_of(names: dict[int, str], module: nn.Module | None) -> str | None:
    return names.get(id(module)) if module is not None else None


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outermost_names(found: list[str]) -> tuple[str, ...]:
    return tuple(n for n in found if not any(n.startswith(o + ".") for o in found if o != n))


def _inside(blocks: list[nn.Module], names: dict[int, str], wanted) -> tuple[str, ...]:
    """The outermost modules of each block that `wanted` accepts, by name."""
    found = [names[id(m)] for b in blocks for m in b.modules() if m is not b and wanted(m) and id(m) in names]
    return _outermost_names(found)


def _tied(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return tuple(tuple(group) for group in by_tensor.values() if len(group) > 1)


# --- blocks (FSDP units) -----------------------------------------------------------------------

def _block_names(model: nn.Module, names: dict[int, str], class_names: list[str] | None) -> tuple[str, ...]:
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
        missing = sorted(wanted - {type(m).__name__ for m in blocks})
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"shard_modules names {missing}, which the model does not contain; "
                f"its module classes are: {', '.join(present)}"
            )
        chosen = _without_shared_parameters(model, _outermost(blocks), named_by_user=True)
        return tuple(names[id(b)] for b in chosen)

    no_split = set(no_split_modules(model) or ())
    if no_split:
        blocks = [m for m in model.modules() if type(m).__name__ in no_split and m is not model]
        if blocks:
            chosen = _without_shared_parameters(model, _outermost(_repeated_layers(model, blocks)))
            return tuple(names[id(b)] for b in chosen)

    # A list of lists (PVT's stages of layers): the inner lists have no forward of their own,
    # which fully_shard refuses; their elements are the blocks.
    containers = (nn.ModuleList, nn.ModuleDict)
    blocks = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m
              if not isinstance(child, containers)]
    return tuple(names[id(b)] for b in _without_shared_parameters(model, _outermost(blocks)))


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
            warnings.warn(message, SMPWarning, stacklevel=5)
        else:
            log.info(message)
    return [b for index, b in enumerate(blocks) if index not in dropped]


# --- pipeline parts ------------------------------------------------------------------------------

def _pipeline_parts(model: nn.Module) -> tuple[PipelineParts | None, str | None]:
    """(the layer list and the first- / last-stage modules of `model`, None) or (None, why smp
    cannot split it)."""
    try:
        return _find_pipeline_parts(model), None
    except ConfigError as e:
        return None, str(e)


def _find_pipeline_parts(model: nn.Module) -> PipelineParts:
    config = getattr(model, "config", None)
    pp_plan = getattr(config, "base_model_pp_plan", None)
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model and not pp_plan:
        pp_plan = _inferred_pp_plan(base)
    if pp_plan and isinstance(base, nn.Module) and base is not model:
        prefix = next(name for name, m in model.named_children() if m is base)
        keys = list(pp_plan)
        if "layers" not in keys:
            raise ConfigError(f"{type(model).__name__}'s base_model_pp_plan has no 'layers' entry ({keys}); smp cannot split it")
        at = keys.index("layers")
        head = _called(model, "get_output_embeddings")
        head_name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
        if head_name is None:
            raise ConfigError(f"{type(model).__name__} has no output embedding (LM head) among its children; smp splits causal LMs")
        parts = PipelineParts(
            layers=f"{prefix}.layers",
            first=tuple(f"{prefix}.{k}" for k in keys[:at]),
            last=tuple(f"{prefix}.{k}" for k in keys[at + 1:]) + (head_name,),
            hf=True,
        )
        placed = {prefix, head_name} | {p.split(".", 1)[1] for p in parts.first + parts.last if p.startswith(prefix + ".")}
        stray = [f"{prefix}.{n}" for n, m in base.named_children() if n not in placed and n != "layers" and _has_params(m)]
        stray += [n for n, m in model.named_children() if n not in placed and _has_params(m)]
        if stray:
            raise ConfigError(
                f"{type(model).__name__} holds parameters outside its base_model_pp_plan ({', '.join(stray)}): smp "
                f"does not know which pipeline stage they belong to; pipeline_parallel_degree: 1 for this model"
            )
        return parts
    children = list(model.named_children())
    lists = [i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError(
            f"smp splits a transformers causal LM (one with a base_model_pp_plan) or a plain model whose "
            f"children are [modules before], one nn.ModuleList of blocks, [modules after]; "
            f"{type(model).__name__} has {len(lists)} nn.ModuleList children"
        )
    at = lists[0]
    return PipelineParts(
        layers=children[at][0], first=tuple(n for n, _ in children[:at]),
        last=tuple(n for n, _ in children[at + 1:]), hf=False,
    )


def _inferred_pp_plan(base: nn.Module) -> list[str] | None:
    """The base_model_pp_plan a transformers model without one would have, read off its
    children: what holds parameters before its one `layers` ModuleList (the embedding), the list,
    and after it what holds parameters or is named a norm (the final norm). A guess only in
    where it cuts: check_layer_chain then proves the forward is that chain, or refuses; modules
    with parameters it leaves out are refused in find_parts. None: no `layers` list."""
    children = list(base.named_children())
    names = [n for n, _ in children]
    if "layers" not in names or not isinstance(base.layers, nn.ModuleList):
        return None
    at = names.index("layers")
    before = [n for n, m in children[:at] if _has_params(m)]
    after = [n for n, m in children[at + 1:] if _has_params(m) or "norm" in n.lower()]
    return before + ["layers"] + after
