"""The style registry: every style name a tensor-parallel plan may hold, with its factory and the
facts smp's plan rules read (does it open a region? gather its output? take parameter entries?).

A name is either applied (it has a `build`) or refused (it has a `refused` reason that the plan
error quotes). The names are transformers 5.23's style vocabulary (`ALL_PARALLEL_STYLES`) plus
smp's own (the ones smp adds itself: `gather_sequence`, `region_entry`, `whole_sequence`, ...).
Code compares style names only through this module: the facts below, or the constants for the
few styles a rule names by identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Union

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from smp.errors import ConfigError
from smp.tensor_parallel.lora import is_lora_layer
from smp.tensor_parallel.moe import MoeExperts
from smp.tensor_parallel.styles import (
    SEQ_DIM, Conv1DColwise, Conv1DRowwise, LocalParams, MlaKvAProj, OwnedOutput, PackedColwise, RegionEntry,
    ReplicateParams, ReplicatedPartialGrad, ReplicateToSequence, ShardSequenceAtEntry, WholeSequence, is_conv1d,
)

StyleSpec = Union[str, ParallelStyle]  # a style by its registered name, or a ParallelStyle object


@dataclass
class Assignment:
    """One module's style, as the plan and the rules assign it (tp_plan.py, rules.py)."""

    name: str
    module: nn.Module
    style: StyleSpec
    is_head: bool = False
    # Layers inside an MoE block run on its gathered plain input even under sequence parallel.
    sequence_parallel: bool = True
    param_styles: dict[str, str] = field(default_factory=dict)  # `moe_tp_experts`: per parameter
    why: str = ""  # set on entries smp added itself, for `model._smp_tp_plan`


@dataclass(frozen=True)
class Options:
    sequence_parallel: bool = False
    loss_parallel: bool = False


@dataclass(frozen=True)
class Request:
    """What a style's factory is built from: the plan entry's module and the TP options."""

    name: str  # module name, for messages
    module: nn.Module
    opts: Options
    is_head: bool
    param_styles: dict[str, str]  # per-parameter entries (moe_tp_experts, local_params)
    model: nn.Module


# Which modules a style can be put on (checked before anything is split).
ANY, SPLITTABLE, PROJECTION, EMBEDDING = "any module", "Linear/Conv1D/Embedding", "Linear/Conv1D", "Embedding"


@dataclass(frozen=True)
class Style:
    build: Callable[[Request], ParallelStyle | None] | None  # None: refused (see `refused`)
    applies_to: str = SPLITTABLE
    opens_region: bool = False  # the parent computes on this rank's heads/features from here on
    gathered_region: bool = False  # opens a region whose activations are gathered whole (Phi-3)
    closes_region: bool = False  # a rowwise layer: the parent's per-rank work is summed here
    packed_parts: int = 1  # output parts fused in one weight ([q | k | v]: 3), each split alone
    on_modules: bool = True  # may name a module (False: only a parameter under moe_tp_experts)
    on_parameters: bool = False  # may name a parameter under a moe_tp_experts module
    replicated: bool = False  # whole on every rank with a whole gradient: nothing to apply
    refused: str = ""  # why smp does not apply it, and what to do instead


def _seq_in(opts: Options) -> Shard | Replicate:
    return Shard(SEQ_DIM) if opts.sequence_parallel else Replicate()


def _col(r: Request) -> type[ColwiseParallel]:
    return Conv1DColwise if is_conv1d(r.module) else ColwiseParallel


def _row(r: Request) -> type[RowwiseParallel]:
    return Conv1DRowwise if is_conv1d(r.module) else RowwiseParallel


def _colwise(r: Request) -> ParallelStyle:
    return _col(r)()  # input arrives replicated (a region's entry gathers it under SP)


def _rowwise(r: Request) -> ParallelStyle:
    # Under sequence parallel a region's closing layer leaves a Shard(1) DTensor on the stream.
    if r.opts.sequence_parallel:
        return _row(r)(output_layouts=_seq_in(r.opts), use_local_output=False)
    return OwnedOutput(_row(r)())


def _head(r: Request) -> ParallelStyle:
    # The LM head sits after the final norm: under SP its input is sequence-sharded.
    if r.opts.loss_parallel:
        return _col(r)(input_layouts=_seq_in(r.opts), output_layouts=Shard(-1), use_local_output=False)
    return _col(r)(input_layouts=_seq_in(r.opts), output_layouts=Replicate())


def _colwise_gathered(r: Request) -> ParallelStyle:
    return _head(r) if r.is_head else _col(r)(output_layouts=Replicate())


def _rowwise_split_input(r: Request) -> ParallelStyle:
    # Closes a gathered region (Phi-3, OLMo2): a full input, split here; under SP the output
    # rejoins the sequence-sharded stream.
    if r.opts.sequence_parallel:
        return _row(r)(input_layouts=Replicate(), output_layouts=_seq_in(r.opts), use_local_output=False)
    return OwnedOutput(_row(r)(input_layouts=Replicate()))


def _embedding(cls: type[ParallelStyle]) -> Callable[[Request], ParallelStyle]:
    def build(r: Request) -> ParallelStyle:
        sp = r.opts.sequence_parallel
        return cls(input_layouts=Replicate(), output_layouts=_seq_in(r.opts), use_local_output=not sp)
    return build


def mla_rope_dim(model: nn.Module, name: str, module: nn.Module) -> int:
    """The rotary key width at the end of an `mla_kv_a_proj` layer's output (the config's
    `qk_rope_head_dim`, as transformers reads it)."""
    rope_dim = getattr(text_config(model), "qk_rope_head_dim", None)
    width = getattr(module, "out_features", 0)
    if not isinstance(module, nn.Linear) or not isinstance(rope_dim, int) or not 0 < rope_dim < width:
        raise ConfigError(
            f"tensor-parallel plan: {name!r} has style 'mla_kv_a_proj', which needs an nn.Linear whose "
            "output ends with the rotary key slice and a model config with `qk_rope_head_dim` smaller "
            f"than that output (got {type(module).__name__}, out_features={width or None}, "
            f"qk_rope_head_dim={rope_dim}); use it on MLA's `kv_a_proj_with_mqa`, or remove the entry"
        )
    return rope_dim


def text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return cfg


# Names rules refer to by identity (each has one job the rules know about).
COLWISE, ROWWISE = "colwise", "rowwise"
HEAD, LM_HEAD = "colwise_gather_output", "lm_head"  # smp puts HEAD on the output head it adds
EMBEDDING_ROWWISE = "embedding_rowwise"
MOE_EXPERTS, LOCAL_PARAMS, MLA_KV_A = "moe_tp_experts", "local_params", "mla_kv_a_proj"
REPLICATE, PARTIAL_GRAD = "replicate", "replicated_with_grad_allreduce"
SEQUENCE_PARALLEL, GATHER_SEQUENCE, REGION_ENTRY = "sequence_parallel", "gather_sequence", "region_entry"
WHOLE_SEQUENCE, REPLICATE_TO_SEQUENCE, REPLICATE_PARAMS = "whole_sequence", "replicate_to_sequence", "replicate_params"
SHARD_SEQUENCE = "shard_sequence"

_NO_EP = ("expert parallelism (whole experts per rank); smp has none. Leave the model's own "
          "`base_model_tp_plan` (its 'moe_tp_experts' entries split every expert over the TP ranks), "
          "or remove the entry")

STYLES: dict[str, Style] = {
    COLWISE: Style(_colwise, opens_region=True, on_parameters=True),
    ROWWISE: Style(_rowwise, closes_region=True, on_parameters=True),
    "colwise_rep": Style(_colwise_gathered, gathered_region=True),
    HEAD: Style(_colwise_gathered, gathered_region=True),
    "rowwise_rep": Style(_rowwise_split_input, closes_region=True),
    "rowwise_split_input": Style(_rowwise_split_input, closes_region=True),
    EMBEDDING_ROWWISE: Style(_embedding(RowwiseParallel), applies_to=EMBEDDING),  # vocab-parallel
    "embedding_colwise": Style(_embedding(ColwiseParallel), applies_to=EMBEDDING),
    "packed_colwise": Style(lambda r: PackedColwise(2), applies_to=PROJECTION, opens_region=True,
                            packed_parts=2, on_parameters=True),
    "packed_qkv_colwise": Style(lambda r: PackedColwise(3), applies_to=PROJECTION, opens_region=True,
                                packed_parts=3),
    # transformers' dimension-named style for expert weights: read under moe_tp_experts only.
    "packed_rowwise": Style(None, applies_to=PROJECTION, on_modules=False, on_parameters=True),
    SEQUENCE_PARALLEL: Style(lambda r: SequenceParallel(sequence_dim=SEQ_DIM), applies_to=ANY),
    PARTIAL_GRAD: Style(lambda r: ReplicatedPartialGrad(), applies_to=ANY),
    REPLICATE: Style(lambda r: None, applies_to=ANY, replicated=True),
    MOE_EXPERTS: Style(lambda r: MoeExperts(r.param_styles, r.name), applies_to=ANY),
    GATHER_SEQUENCE: Style(lambda r: RegionEntry(Shard(SEQ_DIM)), applies_to=ANY),
    REGION_ENTRY: Style(lambda r: RegionEntry(Replicate()), applies_to=ANY),
    REPLICATE_TO_SEQUENCE: Style(lambda r: ReplicateToSequence(), applies_to=ANY),
    LM_HEAD: Style(_head),
    WHOLE_SEQUENCE: Style(lambda r: WholeSequence(SEQ_DIM), applies_to=ANY),
    REPLICATE_PARAMS: Style(lambda r: ReplicateParams(), applies_to=ANY),
    MLA_KV_A: Style(lambda r: MlaKvAProj(mla_rope_dim(r.model, r.name, r.module))),
    LOCAL_PARAMS: Style(lambda r: LocalParams(tuple(r.param_styles)), applies_to=ANY),
    SHARD_SEQUENCE: Style(lambda r: ShardSequenceAtEntry(SEQ_DIM, r.name), applies_to=ANY),
    "grouped_gemm": Style(None, refused=_NO_EP),
    "ep_dispatch_experts": Style(None, refused=_NO_EP),
    "moe_identity_expert": Style(None, refused=(
        "zero (identity) experts; smp does not split them. Remove the model's "
        "'moe_tp_experts' entries to keep the experts replicated")),
    "all_reduce": Style(None, refused=(
        "sums a module's partial output, which needs parameter entries smp does not "
        "split outside 'moe_tp_experts'. Remove the entry and those it pairs with")),
}

STYLE_NAMES = tuple(n for n, s in STYLES.items() if not s.refused)
REFUSED_STYLES = {n: s.refused for n, s in STYLES.items() if s.refused}
# Styles smp reads on parameter entries: expert weights under a module styled `moe_tp_experts`
# (all four), per-head parameters under one styled `local_params` ('colwise' only).
EXPERT_PARAM_STYLES = tuple(n for n, s in STYLES.items() if s.on_parameters)


def fact(style: Any, name: str) -> Any:
    """`STYLES[style].<name>` for a style name; False for a ParallelStyle object (facts unknown,
    applied as given) or an unknown name (refused earlier by the plan check)."""
    info = STYLES.get(style) if isinstance(style, str) else None
    return getattr(info, name) if info is not None else False


def build_style(a: Assignment, opts: Options, model: nn.Module) -> ParallelStyle | None:
    """The ParallelStyle for assignment `a` (None: nothing to apply). Layers inside an MoE block
    (`a.sequence_parallel` False) run on its gathered input, so without sequence parallel."""
    if isinstance(a.style, ParallelStyle):
        return a.style
    info = STYLES[a.style]
    if info.build is None:
        raise KeyError(a.style)
    local = opts if a.sequence_parallel else replace(opts, sequence_parallel=False)
    return info.build(Request(a.name, base_layer(a.module), local, a.is_head, a.param_styles, model))


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a style is built for: a PEFT LoRA layer's base layer (GPT-2's Conv1D under its
    adapters), else `module` (lora.py places the adapters)."""
    return module.base_layer if is_lora_layer(module) else module
