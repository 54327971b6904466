"""Activation checkpointing: `full` (recompute whole blocks) and `selective` (op-level).

The block's own `forward` is replaced, on the instance, by one that runs the class's forward
under torch's non-reentrant `torch.utils.checkpoint.checkpoint`. The module tree, parameter
names and state-dict keys stay exactly as the user wrote them (no `_checkpoint_wrapped_module.`
prefixes), so checkpoints load with or without this feature. FSDP2's hooks run around this
forward once; the recompute in backward calls the class's forward directly, while FSDP holds
the block's parameters gathered for backward. (torch's hook-based composable `checkpoint`
re-runs the module's hooks in recompute: FSDP's mixed-precision input cast then runs inside
selective checkpointing's recompute and breaks its op-for-op replay.)
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from smp.activations.ops import op_matcher
from smp.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("none", "full", "selective")


def apply_activation_checkpointing(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    mode: str,
    every_n_layers: int = 1,
    save_ops: Sequence[str] = (),
) -> list[nn.Module]:
    """Checkpoint every n-th block in place; returns `blocks` unchanged (same objects, same order).

    `mode`: "none", "full" (recompute whole blocks) or "selective" (keep the outputs of the ops
    in `save_ops`, recompute the rest); the config's `activation_checkpointing` documents each.
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return blocks
    if not blocks:
        raise ConfigError(
            f"activation_checkpointing: {mode} found no blocks to checkpoint in "
            f"{type(model).__name__}; name the block class in shard_modules"
        )
    _disable_kv_cache(model)
    context_fn = selective_context_fn(save_ops) if mode == "selective" else noop_context_fn
    for index, block in enumerate(blocks):
        if index % every_n_layers == 0:
            # An instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it.
            block.__dict__["forward"] = CheckpointedForward(block, context_fn, block.__dict__.get("forward"))
    return blocks


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


class CheckpointedForward:
    """`module.forward` under non-reentrant checkpoint. A class, not a closure, so that
    `copy.deepcopy(model)` gives the copy its own (bound to the copy)."""

    def __init__(self, module: nn.Module, context_fn, inner=None) -> None:
        self.module = module
        self.context_fn = context_fn
        self.inner = inner  # a forward already set on the instance (e.g. by accelerate's hooks)

    def __call__(self, *args, **kwargs):
        forward = self.inner or functools.partial(type(self.module).forward, self.module)
        if not torch.is_grad_enabled():  # eval / no_grad: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        # context_fn only when one is set: under torch.compile (smp/compile.py) the `is` test is
        # also what makes dynamo resolve the attribute, which its checkpoint tracing needs.
        context = {} if self.context_fn is noop_context_fn else {"context_fn": self.context_fn}
        return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)


def selective_context_fn(save_ops: Sequence[str]):
    """context_fn for torch's checkpoint: save the outputs of `save_ops`, recompute the rest."""
    # A fresh pair of contexts per checkpointed call: they cache that call's saved outputs.
    return functools.partial(create_selective_checkpoint_contexts, SaveListPolicy(list(save_ops)))


class SaveListPolicy:
    """Selective-checkpoint policy: MUST_SAVE for the listed ops, PREFER_RECOMPUTE for the rest.
    A class (pickled by its op names) so that a checkpointed model can still be pickled."""

    def __init__(self, save_ops: list[str]) -> None:
        self.save_ops = list(save_ops)
        self._is_saved = op_matcher(self.save_ops)

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if self._is_saved(op) else CheckpointPolicy.PREFER_RECOMPUTE

    def __getstate__(self) -> dict:
        return {"save_ops": self.save_ops}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["save_ops"])


def _disable_kv_cache(model: nn.Module) -> None:
    """A Hugging Face model's KV cache would be appended to again by every recompute.

    Every config the forward may read is turned off, not only the top-level one: submodels keep
    their own copies (T5's encoder and decoder stacks), composite configs nest per-part configs
    (`text_config`), and a `generation_config` carries its own `use_cache`.
    """
    switched = []
    for config in _model_configs(model):
        if getattr(config, "use_cache", False):
            config.use_cache = False
            switched.append(type(config).__name__)
    if switched:  # expected whenever checkpointing meets an HF model (docs/activation-memory.md): not a warning
        log.info(
            "activation checkpointing sets use_cache = False in %s (a KV cache is for generation, and "
            "recompute would append to it twice)", ", ".join(sorted(set(switched))),
        )


def _model_configs(model: nn.Module) -> list:
    """Each distinct config object reachable from the model's modules: `config`,
    `generation_config`, and the configs nested in those (found by attribute, any depth)."""
    found: dict[int, object] = {}
    pending = [getattr(m, attr, None) for m in model.modules() for attr in ("config", "generation_config")]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "to_dict"):
            continue  # only config objects (transformers' PretrainedConfig / GenerationConfig)
        found[id(config)] = config
        pending.extend(v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "__dict__"))
    return list(found.values())


def mode_advice(mode: str, compiled: bool) -> str | None:
    """What `smp plan` says about the checkpointing mode for an eager or compiled run, or None.

    Eager selective checkpointing runs every op of a checkpointed block through torch's two Python
    dispatch modes (`_CachingTorchDispatchMode` in forward, `_CachedTorchDispatchMode` in the
    recompute): ~35 Python calls per op, so where the host sets the pace it is slower than `full`
    although it recomputes no matmul. Under torch.compile those modes vanish into the graph."""
    if mode == "selective" and not compiled:
        return (f"activation_checkpointing selective in eager: every op of a checkpointed block passes through "
                f"torch's Python dispatch modes, so a host-bound step pays more than full's recompute "
                f"({SELECTIVE_EAGER_NOTE}); in eager pick full, with every_n_layers: k to trade memory back for "
                f"speed, and selective under compile: true")
    if mode == "full" and compiled:
        return ("activation_checkpointing full under compile: selective keeps the matmul outputs and, "
                f"compiled, loses torch's Python dispatch modes ({SELECTIVE_COMPILED_NOTE}): pick it when its "
                "memory fits")
    return None


# Measured on the CPU proxy of the GPU check's host-bound step (bench/bench_host.py --checkpointing:
# tiny-width 16-layer Llama, bf16 params, smp at world 1, thread-CPU medians): the step relative
# to no checkpointing, eager and with the blocks compiled (aot_eager).
SELECTIVE_EAGER_NOTE = "host-bound proxy, step vs none: selective 1.57x, full 1.19x; BENCHMARKS.md, host section"
SELECTIVE_COMPILED_NOTE = "host-bound proxy, compiled, step vs none: selective 1.17x, full 1.24x"
