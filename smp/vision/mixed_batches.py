"""Batches where some ranks hold no image: the vision tower still runs on every rank.

A VLM runs its vision tower (and projector) only when the batch holds images. Under FSDP the
tower's units all-gather their parameters when they run and reduce-scatter gradients in
backward: if one rank's rows are text-only, the others call collectives it never calls, and the
job dies (gloo aborts the process; NCCL hangs). Mixed text-only and image rows are the normal
case in VLM fine-tuning, so smp makes the tower run on every rank, as ZeRO-3 VLM trainers do: a
rank without an image runs it on a blank image, at the point of the forward where the others
run it on theirs, and adds `0 * (sum of its outputs)` to the model's hidden states. Its forward
and backward then call the same collectives in the same order as everyone else's, and it adds
exactly zero to every value and gradient: the result equals the one-process run on the
global batch.

The blank run must touch exactly the parameters the image path of the forward touches: one
more or one fewer with a gradient and FSDP's reduce-scatter sizes differ between ranks (gloo
aborts on the mismatch). So it takes only `pooler_output` of `get_image_features` (the image
features the forward scatters into the text), and it runs only on the multimodal models whose
blank run is proven exact against one process (`PROVEN`, tests/models/test_vlm.py).

Ranks agree first, with one 2-element all-reduce per forward, whether the batch is mixed; any
other model is refused then, on every rank, naming the model, its image-path modules and the
reason, before any collective diverges.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.errors import ConfigError


# The forward arguments that carry images (Pix2Struct and Kosmos-2.5 take flattened patches).
IMAGE_INPUTS = ("pixel_values", "flattened_patches", "image_patches")


def image_paths(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each multimodal model inside `model` whose forward takes `pixel_values`
    and runs its image path through `get_image_features` (LlavaModel, Qwen2_5_VLModel,
    Gemma3Model, PaliGemmaModel, ...): the innermost such module of each branch."""
    found = [
        (name, m) for name, m in model.named_modules()
        if callable(getattr(m, "get_image_features", None))
        and "pixel_values" in inspect.signature(m.forward).parameters
    ]
    return _innermost(found)


def _innermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in found if not any(c is not m and c in set(m.modules()) for _, c in found)]


# The multimodal models (the class defining `get_image_features`) whose blank-image run is proven
# exact vs one process at world 2 (loss and every gradient within 1e-5): 3 SGD steps in
# tests/models/test_vlm.py for the first eleven, one step in the model-coverage matrix's "mixed batch"
# column (docs/model-coverage.md) for the rest. Another model may need more than the pixels, or
# use more outputs of its tower than `pooler_output` (Qwen3-VL's deepstack features, which the
# tiny shape does not exercise): it is refused until a test proves it.
PROVEN = frozenset({
    "LlavaModel", "VipLlavaModel", "Qwen2VLModel", "Qwen2_5_VLModel", "Gemma3Model", "PaliGemmaModel",
    "Idefics3Model", "SmolVLMModel", "AyaVisionModel", "InternVLModel", "GotOcr2Model",
    "Idefics2Model", "Cohere2VisionModel", "Ovis2Model", "QianfanOCRModel", "Glm4vModel", "GlmOcrModel",
    "Exaone4_5_Model",
})


def _proven(module: nn.Module) -> bool:
    return any(c.__name__ in PROVEN for c in type(module).__mro__)


def _blank_image(module: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, Any] | None:
    """Keyword arguments of `get_image_features` for one blank image of the smallest size the
    tower takes, or None when smp does not know this tower's input layout."""
    config = getattr(module, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None or not callable(getattr(module, "get_image_features", None)):
        return None
    params = inspect.signature(module.get_image_features).parameters
    if "image_grid_thw" in params:  # Qwen2-VL / Qwen2.5-VL: flattened patches + their grid
        merge = getattr(vision, "spatial_merge_size", None)
        patch = getattr(vision, "patch_size", None)
        temporal = getattr(vision, "temporal_patch_size", None)
        channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
        if None in (merge, patch, temporal):
            return None
        return {"pixel_values": torch.zeros(merge * merge, channels * temporal * patch * patch, device=device, dtype=dtype),
                "image_grid_thw": torch.tensor([[1, merge, merge]], device=device)}
    size, channels = getattr(vision, "image_size", None), getattr(vision, "num_channels", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if not isinstance(size, int) or not isinstance(channels, int):
        return None
    if any(p.default is inspect.Parameter.empty and n not in ("self", "pixel_values") and p.kind not in
           (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) for n, p in params.items()):
        return None  # it needs more than the pixels (aspect ratios, tile masks): not known here
    if "pixel_attention_mask" in params:
        # Idefics3 / SmolVLM: (rows, images per row, channels, height, width) and a pixel mask; an
        # all-zero image counts as padding there and is dropped, so the blank image is all ones.
        return {"pixel_values": torch.ones(1, 1, channels, size, size, device=device, dtype=dtype),
                "pixel_attention_mask": torch.ones(1, 1, size, size, device=device, dtype=torch.bool)}
    return {"pixel_values": torch.zeros(1, channels, size, size, device=device, dtype=dtype)}


def _user_class_name(module: nn.Module) -> str:
    """The model's own class name (FSDP2 re-classes a sharded module as `FSDP<Name>`)."""
    name = type(module).__name__
    return name[4:] if name.startswith("FSDP") and name[4:] in {c.__name__ for c in type(module).__mro__} else name


def _features_sum(output: Any) -> torch.Tensor | None:
    """The sum of the image features `get_image_features` returned (its `pooler_output`: what
    the forward scatters into the text), or None when it returned none."""
    features = getattr(output, "pooler_output", None)
    return None if features is None else _float_sum(features)


def _float_sum(value: Any) -> torch.Tensor | None:
    """The sum of every floating-point tensor inside `value` (tensors, tuples, lists, dicts,
    ModelOutputs), or None when it holds none."""
    if isinstance(value, torch.Tensor):
        return value.float().sum() if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    total = None
    for item in items:
        s = _float_sum(item)
        if s is not None:
            total = s if total is None else total + s
    return total


class _ImagePathOnEveryRank:
    """Forward hooks on one multimodal module (see the module docstring)."""

    def __init__(self, name: str, module: nn.Module, groups: list[dist.ProcessGroup]) -> None:
        self.name, self.groups = name, groups
        self.towers: list[str] = []  # the image-path modules, outermost, for the error message
        for n, _ in module.named_modules():
            last = n.rpartition(".")[2]
            if any(k in last for k in ("vision", "visual", "projector", "merger", "image")) and \
                    not any(n.startswith(t + ".") for t in self.towers):
                self.towers.append(n)
        self.signature = inspect.signature(module.forward)
        self.pending: torch.Tensor | None = None

    def _has_images(self, args: tuple, kwargs: dict) -> bool:
        try:
            arguments = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            arguments = kwargs
        return any(arguments.get(k) is not None for k in IMAGE_INPUTS)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        has = self._has_images(args, kwargs)
        device = next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
        flags = torch.tensor([int(has), int(not has)], dtype=torch.int64,
                             device=device if device.type != "meta" else "cpu")
        for group in self.groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        if not (flags[0] and flags[1]):
            return  # every rank has images, or none has: all call the same collectives
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        blank = _blank_image(module, flags.device, dtype) if _proven(module) else None
        if blank is None:
            why = ("its tower needs more than the pixels (image sizes, aspect ratios, tile masks)"
                   if callable(getattr(module, "get_image_features", None)) and _proven(module) else
                   "a blank-image run is proven exact only on " + ", ".join(sorted(PROVEN)))
            raise ConfigError(
                f"some ranks' batches hold images and others' do not, and smp cannot run "
                f"'{self.name or '<root>'}' ({_user_class_name(module)})'s image path "
                f"({', '.join(self.towers) or 'its image encoder'}) on a blank image for the text-only "
                f"ranks ({why}): their FSDP units would all-gather on some ranks only. Give every rank "
                "at least one image per step (e.g. a sampler that mixes image and text rows per rank)."
            )
        if not has:
            self.pending = _features_sum(module.get_image_features(**blank, return_dict=True))

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.pending is None:
            return output
        zero, self.pending = 0.0 * self.pending, None
        if isinstance(output, tuple):
            return (output[0] + zero.to(output[0].dtype), *output[1:])
        output.last_hidden_state = output.last_hidden_state + zero.to(output.last_hidden_state.dtype)
        return output


def install_image_path_on_every_rank(model: nn.Module, groups: list[dist.ProcessGroup]) -> list[str]:
    """Make each multimodal module of `model` run its image path on every rank of `groups`
    (the data-parallel process groups its FSDP units communicate over, one per mesh dimension)
    whenever some ranks' batches hold images and others' do not. Returns the modules' names."""
    if not groups:
        return []
    names = []
    found = image_paths(model)
    if not found and set(IMAGE_INPUTS) & set(inspect.signature(model.forward).parameters):
        found = [("", model)]  # an image path smp cannot run on a blank image: refused when mixed
    for name, module in found:
        hooks = _ImagePathOnEveryRank(name, module, groups)
        module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
        module.register_forward_hook(hooks.post, with_kwargs=True)
        names.append(name)
    return names
