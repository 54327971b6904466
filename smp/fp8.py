"""FP8 training through torchao's float8 (`fp8: {recipe: tensorwise | rowwise, all_gather}`, docs/config.md).

`apply_fp8(model, recipe)` swaps the model's `nn.Linear` layers for torchao's `Float8Linear`
(matmuls in float8 with dynamic scales, weights and gradients kept in their dtype), before tensor
parallel and FSDP wrap them, as torchtitan orders it. Left out: the output head (its logits feed
the loss; fp8 there costs accuracy for little time) and layers whose widths are not multiples of
16 (`torch._scaled_mm`'s requirement), and mixture-of-experts routers (`router`, `gate`). Experts
held as `[E, ...]` parameters (transformers 5's fused experts) are no Linear and stay as they are.

FSDP gathers the weights in their own dtype unless `fp8.all_gather` is on (`apply_fp8(...,
all_gather=True)`: torchao's `enable_fsdp_float8_all_gather`). Then each converted weight is
torchao's `WeightWithDynamicFloat8CastTensor`: before FSDP's all-gather every rank casts its shard
to float8 with the scale of the whole weight (its amax all-reduced over FSDP's shard mesh), so
the gathered float8 weight is bit for bit the one the run without it casts after gathering.
That holds where FSDP's mesh is the whole weight: under FSDP and HSDP (the replicas hold the same
weight). Under TP x FSDP torchao reduces the amax over the FSDP mesh alone and each TP shard gets
its own scale (gradients 1e-2 off) unless torchao's `precompute_float8_dynamic_scale_for_fsdp`
runs after every optimizer step, which smp does not own: refused, with everything else not
proven with it (smp/composition.py's table, the config's validators, `check_fp8_materialized`).
The weights' class is torchao's only inside the run: `plain_weights` gives checkpoints and
exports the plain tensors.

Under tensor parallel the layers keep smp's plan styles (torch's ColwiseParallel /
RowwiseParallel): a sharded weight or activation is a DTensor, whose amax reduces over the TP
group, so each rank casts with the scales one process would use. torchao's float8 TP styles are
not needed for that (they move the all-gather of activations to float8, tensorwise only). The
packed styles (a fused q|k|v or gate|up split per part) multiply each rank's shard as a plain
tensor, so a float8 layer there would scale by its shard's amax: `check_fp8_tp_layers` refuses
it. Under data parallelism each rank's activation and gradient scales come from its own rows.

`check_fp8(recipe, device)` is called by `smp.init`: float8 matmuls need a CUDA device of
compute capability >= 8.9 (Ada, Hopper and later) and torchao; anything else is refused there,
naming the requirement, before the process group exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from smp.errors import ConfigError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
_HEAD_NAMES = ("lm_head", "output", "head", "score", "classifier")
# A mixture-of-experts router (a Linear in user models and older transformers: `router`, `gate`):
# its logits pick the experts, where float8 rounding flips choices for little time saved.
_ROUTER_NAMES = ("router", "gate")


def check_fp8(recipe: str | None, device: torch.device) -> None:
    """ConfigError unless this run can train in float8 (`recipe` None: fp8 is off)."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ConfigError(f"fp8.recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    need = f"a CUDA device of compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or later)"
    if device.type != "cuda":
        raise ConfigError(
            f"fp8: {{recipe: {recipe}}} needs {need}; this run is on {device.type}: remove the fp8 section"
        )
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(
            f"fp8: {{recipe: {recipe}}} needs {need}; {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}: remove the fp8 section (bf16 mixed precision instead)"
        )
    _float8_api()


def _float8_api() -> Any:
    try:
        from torchao import float8
    except ImportError as e:
        raise ConfigError(f"fp8 training needs torchao (pip install torchao): {e}") from None
    return float8


def fp8_layer(name: str, module: nn.Module) -> bool:
    """Whether `name` is converted: an nn.Linear, not the output head nor a router, widths
    multiples of 16."""
    if type(module) is not nn.Linear:
        return False
    if name.rpartition(".")[2] in _HEAD_NAMES + _ROUTER_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, recipe: str, all_gather: bool = False) -> list[str]:
    """Swap the model's Linear layers for torchao's Float8Linear (`recipe`'s scaling); returns
    the converted layers' names. Works on the meta device (the swap keeps the parameters).
    `all_gather` (tensorwise only): their weights become torchao's float8-castable subclass, which
    FSDP2 all-gathers in float8 (`enable_fsdp_float8_all_gather`)."""
    float8 = _float8_api()
    names = [name for name, module in model.named_modules() if fp8_layer(name, module)]
    if names:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        if all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in names)
    return names


def check_fp8_materialized(all_gather: bool, materialize_meta: bool) -> None:
    """ConfigError if `fp8.all_gather` meets a meta-device model that smp.transform would
    initialise (`materialize_meta`): that initialisation does not handle torchao's weight class."""
    if all_gather and materialize_meta:
        from smp.config import FP8_GATHER_ON_META

        raise ConfigError(FP8_GATHER_ON_META)


def check_fp8_tp_layers(model: nn.Module) -> None:
    """ConfigError if a float8 layer's tensor-parallel style multiplies local shards (the packed
    styles: its weight is split per part, `_StridedShard`), where its scales would come from this
    rank's shard instead of the whole weight. Called by smp.transform after tensor parallel."""
    from torch.distributed.tensor import DTensor

    from smp._compat import strided_shard_type

    float8 = _float8_api()
    strided = strided_shard_type()
    applied = getattr(model, "_smp_tp_plan", {})
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, float8.float8_linear.Float8Linear) and isinstance(weight, DTensor) and \
                any(isinstance(p, strided) for p in weight.placements):
            style = applied.get(name, "packed_colwise").split(" ")[0]
            raise ConfigError(
                f"fp8 with tensor_parallel_degree {weight.device_mesh.size()}: {name!r} takes the style "
                f"{style!r}, which multiplies each rank's shard of the fused weight on its own, so float8 "
                "would scale it by the shard's amax and differ from one process. Split the fused "
                "projection into one Linear per part (each then 'colwise'), set tensor_parallel_degree: 1, "
                "or remove the fp8 section"
            )


def plain_weights(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a model state dict) with each weight that `fp8.all_gather` wrapped in torchao's
    float8-castable class replaced by its plain tensor (DTensors keep their placements; the
    storage is shared, so loading into the result loads into the model). Checkpoints then hold
    plain tensors of the weights' dtype, readable without torchao. A state without such weights
    comes back as it is."""
    from torch.distributed.tensor import DTensor

    from smp._compat import dtensor_local, float8_castable_weight

    def plain(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        inner = float8_castable_weight(dtensor_local(value))
        if inner is None:
            return value
        if isinstance(value, DTensor):
            return DTensor.from_local(inner.detach(), value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        return inner.detach()

    return {key: plain(value) for key, value in state.items()}
