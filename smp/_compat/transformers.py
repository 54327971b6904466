"""transformers' private names smp reaches (checked on 5.17 and 5.23)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from smp._compat.versions import unsupported, _private

# ----------------------------------------------------------------------------------------------
# transformers (checked 5.17, 5.23)
# ----------------------------------------------------------------------------------------------


def supports_attention_interface(model_cls: type) -> bool:
    """True when the model calls attention through transformers' AttentionInterface, so its
    implementation can be switched: `PreTrainedModel._can_set_attn_implementation`."""
    fn = getattr(model_cls, "_can_set_attn_implementation", None)
    if fn is None:
        raise unsupported("switching a transformers model's attention implementation", "transformers")
    return fn()


def set_config_attention(config: Any, implementation: str) -> None:
    """Make `config`'s model call `implementation` (a name registered with AttentionInterface).
    The config's `_attn_implementation` setter; the public `model.set_attn_implementation`
    also rewrites every sub-config and validates kernels, which this does not want."""
    config._attn_implementation = implementation


def init_weights_function(model: nn.Module) -> Callable[[nn.Module], None]:
    """The per-module initialiser transformers' `initialize_weights` applies (it marks each
    module `_is_hf_initialized`): `PreTrainedModel._initialize_weights`."""
    fn = getattr(model, "_initialize_weights", None)
    if fn is None:
        raise unsupported("replaying transformers' weight initialisation (delayed parameter init)", "transformers")
    return fn


def module_init_function(model: nn.Module) -> Callable[[nn.Module], None]:
    """The model's own initialiser of one module (what `_initialize_weights` calls per module,
    without the `_is_hf_initialized` bookkeeping): `PreTrainedModel._init_weights`."""
    fn = getattr(model, "_init_weights", None)
    if fn is None:
        raise unsupported("running a transformers model's module initialiser (_init_weights)", "transformers")
    return fn


def clear_initialized_marks(objects: Iterable[Any]) -> None:
    """Forget transformers' `_is_hf_initialized` marks on modules and tensors."""
    for obj in objects:
        if "_is_hf_initialized" in getattr(obj, "__dict__", {}):
            del obj._is_hf_initialized


def keys_to_ignore_on_load(model: nn.Module) -> tuple[set[str], set[str]]:
    """(unexpected, missing) key patterns the model class declares harmless on load:
    `_keys_to_ignore_on_load_unexpected` / `_keys_to_ignore_on_load_missing` (empty when absent)."""
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    return unexpected, missing


def no_split_modules(model: nn.Module) -> list[str]:
    """Class names of the model's blocks that must not be split: `_no_split_modules` ([] when
    the model does not say)."""
    return list(getattr(model, "_no_split_modules", None) or ())


def model_tp_plan(model: nn.Module) -> dict[str, Any]:
    """The model's own tensor-parallel plan, with the head and embedding entries its
    `config.base_model_tp_plan` lacks: `PreTrainedModel._tp_plan` ({} when absent)."""
    return dict(getattr(model, "_tp_plan", None) or {})


# Private methods of transformers.Trainer that smp's Trainer integration (smp/integrations/
# trainer.py) overrides or calls on itself; checked on transformers 5.17, 5.23. An override of a
# method the installed Trainer no longer has would silently never run: `check_trainer_overrides`
# refuses that when the Trainer is built. tests/core/test_compat_layer.py allows these names, and
# only these, as overrides.
TRAINER_OVERRIDES = frozenset({
    "_move_model_to_device", "_track_num_input_tokens", "_clip_grad_norm", "_get_grad_norm",
    "_save_checkpoint", "_get_output_dir", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
    "_load_scaler", "_load_rng_state",
})
# Extension points other libraries ask subclasses to implement under a private name. A missing
# base method fails loudly there (an abstract method), so no version check is needed.
EXTENSION_POINTS = frozenset({"_apply"})  # torch's ParallelStyle (custom tensor-parallel styles)


def check_trainer_overrides() -> None:
    """Raise UnsupportedVersionError when the installed transformers.Trainer lacks a method
    smp's integration overrides (see TRAINER_OVERRIDES)."""
    import transformers

    missing = sorted(n for n in TRAINER_OVERRIDES if not callable(getattr(transformers.Trainer, n, None)))
    if missing:
        raise unsupported(f"smp's Trainer integration (it overrides Trainer.{', Trainer.'.join(missing)})",
                          "transformers", fix="Use transformers 5.17 to 5.23, which smp was checked on.")


def trainer_batch_size(trainer: Any) -> int:
    """The per-device batch size the Trainer uses now (auto_find_batch_size may have lowered
    `args.train_batch_size`): `Trainer._train_batch_size`."""
    size = getattr(trainer, "_train_batch_size", None)
    if size is None:
        raise unsupported("reporting the Trainer's batch size (Trainer._train_batch_size)", "transformers")
    return size



# ----------------------------------------------------------------------------------------------
# transformers: checkpoint key conversion (checked 5.23)
# ----------------------------------------------------------------------------------------------


class CheckpointConversion:
    """transformers' own conversion of `model`'s checkpoint keys and tensors, as `from_pretrained`
    applies it (`core_model_loading.convert_and_load_state_dict_in_model`, checked on 5.23):

    - `rename(key, model_keys) -> (model key, source pattern or None)`: the key after every
      `WeightRenaming`, then at most one `WeightConverter` (`rename_source_key`); the pattern is
      the converter's source pattern that matched, None when the key is only renamed.
    - `convert(pattern, layer, sources) -> {model key: tensor}`: a fresh copy of the
      converter owning `pattern` (from_pretrained deep-copies one per target) is given the
      tensors of `sources` ({source pattern: [(file key, tensor or a function reading it)]}, in
      `key_order`) under `layer` (the first target's model key, from_pretrained's "layer name")
      and runs its operations (`WeightConverter.convert`, which names each result).
    - `key_order`: the sort key from_pretrained visits a checkpoint's keys in
      (`dot_natural_key`: `experts.2` before `experts.10`), which is the order a converter
      stacks its sources in.
    - `converter_of(pattern)`: the converter itself (the same object for each of its patterns).
    - `stacking(pattern)`, `source_patterns(pattern)`: its operations when it only stacks
      (`MergeModulelist`) and joins (`Concatenate`), and its source patterns in its own order
      (the order a join takes them in).

    `model` must be the plain PreTrainedModel (not FSDP-wrapped: the lookup is by class name and
    module path); a meta-device copy does (operations that size their results read its shapes).
    """

    def __init__(self, model: nn.Module) -> None:
        mapping = _private("transformers.conversion_mapping", "get_model_conversion_mapping")
        self._rename = _private("transformers.core_model_loading", "rename_source_key")
        renaming = _private("transformers.core_model_loading", "WeightRenaming")
        converter = _private("transformers.core_model_loading", "WeightConverter")
        self.key_order = _private("transformers.core_model_loading", "dot_natural_key")
        if None in (mapping, self._rename, renaming, converter, self.key_order):
            raise unsupported("loading Hugging Face checkpoints through transformers' weight conversion", "transformers")
        conversions = mapping(model) or []
        self._renamings = [c for c in conversions if isinstance(c, renaming)]
        self._converters = [c for c in conversions if isinstance(c, converter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self.model = model
        self.empty = not conversions

    def rename(self, key: str, model_keys: Any) -> tuple[str, str | None]:
        return self._rename(key, self._renamings, self._converters, self._prefix, model_keys)

    def converter_of(self, pattern: str) -> Any:
        return self._by_pattern[pattern]

    def stacking(self, pattern: str) -> list[tuple[str, int]] | None:
        """The operations of the converter owning `pattern` as [("stack", dim) | ("cat", dim)] when
        each is exactly transformers' `MergeModulelist` (`torch.stack` of each source pattern's
        list) or `Concatenate` (`torch.cat` over the source patterns in the converter's order);
        None when any is something else. The converter's source patterns: `source_patterns(pattern)`."""
        merge = _private("transformers.core_model_loading", "MergeModulelist")
        concatenate = _private("transformers.core_model_loading", "Concatenate")
        if merge is None or concatenate is None:
            return None
        steps = []
        for op in self._by_pattern[pattern].operations:
            if type(op) is merge:
                steps.append(("stack", op.dim))
            elif type(op) is concatenate:
                steps.append(("cat", op.dim))
            else:
                return None
        return steps

    def source_patterns(self, pattern: str) -> list[str]:
        return list(self._by_pattern[pattern].source_patterns)

    def convert(self, pattern: str, layer: str, sources: dict[str, list[tuple[str, Any]]]) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(self._by_pattern[pattern])
        for source_pattern, tensors in sources.items():
            for key, tensor in tensors:
                converter.add_tensor(layer, key, source_pattern, tensor)
        out = converter.convert(layer, model=self.model, config=self.model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}
