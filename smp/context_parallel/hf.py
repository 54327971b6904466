"""Context parallel attention inside Hugging Face models, through transformers' attention
interface: smp registers "smp_cp" (an attention function and a mask function) and sets it as
the model's `config._attn_implementation`; the model's own modeling code then calls it.

The mask function hands the attention the 2-D padding mask of this rank's keys as it is: the
causal / sliding-window masks are built inside the attention from global token indices, and the
key padding travels with its key/value block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp._compat import set_config_attention, supports_attention_interface
from smp.context_parallel.attention import ContextParallelSetup, attention
from smp.context_parallel.sharding import IGNORE_INDEX, chunk_positions, shift_labels
from smp.errors import ConfigError, UsageError

IMPLEMENTATION = "smp_cp"
# The keyword inputs of a causal LM's forward that only its loss reads (what shard_batch adds).
LOSS_INPUTS = ("labels", "shift_labels", "num_items_in_batch")

# Model-config settings whose attention smp cannot reproduce exactly across chunks.
_UNSUPPORTED_CONFIG = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "use_alibi": "ALiBi position biases",
    "alibi": "ALiBi position biases",
}


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def check_hf_model(model: nn.Module) -> None:
    """Raise ConfigError naming the cause when the model's attention cannot be replaced, or not
    exactly (before any collective)."""
    name = type(model).__name__
    if not supports_attention_interface(type(model)):
        raise ConfigError(
            f"context_parallel_degree > 1: {name} does not call its attention through "
            f"transformers' attention interface, so smp cannot replace it with context parallel "
            f"attention; use a model whose attention does, or context_parallel_degree: 1"
        )
    config = model.config
    for key, what in _UNSUPPORTED_CONFIG.items():
        if getattr(config, key, None):
            raise ConfigError(
                f"context_parallel_degree > 1: {name} uses {what} ({key}={getattr(config, key)!r}), "
                f"which smp's context parallel attention does not compute; use context_parallel_degree: 1"
            )
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ConfigError(
            f"context_parallel_degree > 1: {name} has attention_dropout={dropout}; dropout on "
            f"attention probabilities split across ranks cannot match one process: set it to 0"
        )


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, hf_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)


def use_context_parallel_attention(model: nn.Module) -> None:
    register()
    set_config_attention(model.config, IMPLEMENTATION)


def padding_mask(batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None,
                 **_: Any) -> torch.Tensor | None:
    """transformers' mask hook: pass the 2-D key padding mask through (None: no padding)."""
    return attention_mask


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, is_causal: bool | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (B, H, L, D) in, ((B, L, H, D), no weights) out."""
    for unsupported in ("softcap", "position_bias", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise UsageError(f"context parallel attention cannot compute `{unsupported}` exactly across chunks")
    if dropout:
        raise UsageError(f"context parallel attention: dropout={dropout} on attention probabilities is not supported")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UsageError(
            "context parallel attention needs the 2-D padding mask (batch, keys), not a prepared "
            f"{attention_mask.dim()}-D mask: pass attention_mask as smp.context_parallel.shard_batch returns it"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attention(query, key, value, causal=causal, scale=scaling, sliding_window=sliding_window,
                    key_padding_mask=attention_mask, position_ids=kwargs.get("position_ids"))
    return out.transpose(1, 2).contiguous(), None


# --- The inputs of each forward: which tokens of the sequence this rank holds ----------------
#
# Under context parallel a rank's input_ids are 1/cp of each sequence. The model's own defaults
# (position_ids = arange(local length), labels shifted inside the local tokens) would then train
# on another objective without a sign. So every forward of a Hugging Face model must say where
# its tokens sit in the whole sequence, in one of two ways:
# - `smp.context_parallel.shard_batch` output: global position_ids and pre-shifted shift_labels;
# - the SMP v2 layout (`accept_precut_inputs`, set by smp.sagemaker.transform): each sequence was
#   cut by the script into 2 x cp chunks, rank i keeping chunks i and 2cp-1-i (SMP v2's
#   `get_batch_for_cp_rank`). smp knows that layout, so it computes the global positions and
#   the label shift as if the sequence were whole (the labels are gathered over the cp group).
# Anything else is refused before the forward runs: smp never guesses a layout from shapes.

SHARD_BATCH_FIX = (
    "cut whole sequences with smp.context_parallel.shard_batch(batch) and call model(**batch) "
    "(docs/context-parallel.md)"
)


@dataclass
class ForwardInputs:
    setup: ContextParallelSetup
    precut: bool = False  # inputs arrive cut in SMP v2's load-balanced layout


def guard_inputs(model: nn.Module, setup: ContextParallelSetup) -> ForwardInputs:
    """Check (or, for the SMP v2 layout, complete) every forward's inputs; see above."""
    inputs = ForwardInputs(setup=setup)
    model._smp_cp_inputs = inputs  # read by accept_precut_inputs

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, complete_inputs(type(module).__name__, inputs, args, kwargs)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return inputs


def accept_precut_inputs(model: nn.Module) -> None:
    """The SMP v2 path: this model's inputs come cut in SMP v2's layout (2 x cp chunks, rank i
    holds chunks i and 2cp-1-i), which is smp's load-balanced layout."""
    inputs = getattr(model, "_smp_cp_inputs", None)
    if inputs is None:
        return  # context parallel is off, or not a Hugging Face model
    if not inputs.setup.load_balance:
        raise ConfigError(
            "context_parallel.load_balance: false, but SMP v2 scripts cut each sequence into "
            "2 x context_parallel_degree chunks (rank i keeps chunks i and 2cp-1-i), the load-"
            "balanced layout; set context_parallel: {load_balance: true}"
        )
    inputs.precut = True


def with_padding_mask(args: tuple, kwargs: dict) -> dict:
    """`kwargs` with an all-ones 2-D attention_mask where the forward has none. Without a mask
    (and without a cache) transformers reads documents from position_ids; on a rank's chunk the
    global positions of load-balanced chunks (0..3, 12..15) look like several documents, and on
    the meta device (the attention probe) the test reads a value. smp's attention reads packed
    documents from position_ids itself (attention.py); the mask only reaches it as padding."""
    if kwargs.get("attention_mask") is not None:
        return kwargs
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        return kwargs
    return {**kwargs, "attention_mask": torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)}


def complete_inputs(model_name: str, inputs: ForwardInputs, args: tuple, kwargs: dict) -> dict:
    """The forward's keyword arguments with global positions, whole-sequence label shift and a
    padding mask (with_padding_mask)."""
    setup = inputs.setup
    if setup.probing:
        return kwargs
    kwargs = with_padding_mask(args, kwargs)
    if len(args) > 1:
        raise UsageError(
            f"context_parallel_degree={setup.size}: pass {model_name}'s inputs by keyword "
            f"(input_ids=..., labels=...), so that smp can see which ones are positional"
        )
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    has_positions = kwargs.get("position_ids") is not None
    labels = kwargs.get("labels")
    unshifted = labels is not None and kwargs.get("shift_labels") is None
    if not inputs.precut:
        missing = (["position_ids"] if not has_positions else []) + (["shift_labels"] if unshifted else [])
        if missing:
            raise UsageError(
                f"context_parallel_degree={setup.size}: {model_name}'s forward got no "
                f"{' / '.join(missing)}, so smp cannot know which tokens of each sequence this rank "
                f"holds (its own defaults would use local positions and shift labels inside the "
                f"chunk: another objective); {SHARD_BATCH_FIX}"
            )
        return kwargs
    if ids is None:
        return kwargs
    local = ids.shape[1]
    seq_len = local * setup.size
    index = chunk_positions(seq_len, setup.size, setup.rank, load_balance=True, device=ids.device)
    out = dict(kwargs)
    if not has_positions:
        out["position_ids"] = index.expand(ids.shape[0], local)
    if unshifted:
        targets = shift_labels(_whole_sequences(labels, setup, seq_len))
        local_targets = targets.index_select(1, index)
        out["labels"] = out["shift_labels"] = local_targets
        if out.get("num_items_in_batch") is None:
            # each cp rank's loss is its token sum over 1/cp of the rows' targets: the average
            # over the cp ranks (FSDP's gradient mean) is the mean over the whole rows
            out["num_items_in_batch"] = (targets != IGNORE_INDEX).sum() / setup.size
    return out


def _whole_sequences(local: torch.Tensor, setup: ContextParallelSetup, seq_len: int) -> torch.Tensor:
    """The whole (B, seq_len) rows from every cp rank's chunks (SMP v2's layout)."""
    parts = [torch.empty_like(local) for _ in range(setup.size)]
    dist.all_gather(parts, local.contiguous(), group=setup.group)
    whole = local.new_empty(local.shape[0], seq_len)
    for rank, part in enumerate(parts):
        whole[:, chunk_positions(seq_len, setup.size, rank, load_balance=True, device=local.device)] = part
    return whole
