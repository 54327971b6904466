"""LoRA (PEFT) adapters under tensor parallel: the base layer is split by the model's plan as
today, and each adapter pair is placed so that the layer's output equals one process's.

A LoRA layer computes base(x) + B(A(x)) x scaling, A: in -> r, B: r -> out, r small.

- column-wise base (q/k/v, gate/up; output features split, input x whole on every rank):
  lora_A stays whole (replicated, a plain parameter) and lora_B is split column-wise like the
  base, so B's output is this rank's features, added to the base's. The gradient reaching A's
  output is summed over the tp ranks by B's column-wise input (as for the base's input).
- row-wise base (o_proj, down_proj; input features split, partial sums reduced): lora_A is
  split row-wise like the base (input features) and its r-wide partial output is all-reduced;
  lora_B stays whole. One more all-reduce per layer, of r values per token (r << out): the
  reverse (A whole) would need the whole input, an all-gather of `in` values per token.
  Under sequence parallel the base's output is reduce-scattered by sequence, so is A's, and B
  runs whole on the sequence shard (its gradient summed over tp like a sequence-parallel norm's).

- gathered column-wise base (`colwise_gather_output` / `colwise_rep`: OLMo2's q/k/v, Phi-3's
  qkv; input whole, output gathered whole) and its row-wise partner that splits a whole input
  (`rowwise_split_input` / `rowwise_rep`; output summed whole): the layer's input and output are
  whole on every rank and so is the gradient reaching its output (what follows runs whole), so
  both adapters stay whole: they compute one process's values, no collective. (lora_B split with
  its output gathered would equal it too, but then A's gradient is each rank's share until
  summed: one all-gather and one all-reduce per layer for r x out parameters.) Under sequence
  parallel the row-wise partner leaves its output split by sequence: lora_B's whole output is
  sliced the same way (its gradient all-gathered back whole).
- the output head (`colwise_gather_output` on lm_head) under sequence or loss parallel: its
  input is split by sequence (sequence parallel) or its output stays split by vocabulary (loss
  parallel), so the whole placement above does not fit. lora_B is split column-wise like the
  head and gives its output the head's layout (gathered, or a vocab-sharded DTensor); its input,
  A's r-wide output, is gathered by sequence first under sequence parallel (r values per token,
  not the hidden width). lora_A stays whole: on the whole input it is the column-wise case; on
  the sequence shard it runs as a sequence-parallel norm does (its gradient summed over tp).
- packed column-wise base (`packed_qkv_colwise`: GPT-2's fused c_attn, `packed_colwise`: a fused
  gate|up): lora_B is split the same packed way (each part's rows: rank r holds
  [q_r | k_r | v_r]), lora_A stays whole; its output gradient is summed by lora_B's input as
  in the column-wise case.
- a whole layer with its own output hook (`mla_kv_a_proj`: MLA's joint down-projection, whose
  rotary slice's gradient is summed over the ranks): the hook goes on the LoRA layer, so base
  and adapters see the same summed gradient; the adapters stay whole. A whole layer the rules
  leave whole inside MLA (`q_a_proj`, 'replicate') keeps its adapters whole with it: its output
  gradient is already whole (rules.py, `mla_whole_input`).

Adapters stay trainable parameters (DTensors where split), so FSDP shards them beside the base
and `smp.integrations.save_adapter` gathers them whole. Refused (ConfigError, before any
collective): other styles on an adapted layer (experts, embeddings, a gathered layer whose
input or output is split otherwise than above), DoRA, LoRA on embeddings, QLoRA (bitsandbytes
weights).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel, parallelize_module,
)

from smp.errors import ConfigError
from smp.tensor_parallel.styles import SEQ_DIM, OwnedOutput, PackedColwise, ReplicateToSequence

COLWISE, ROWWISE = "colwise", "rowwise"
WHOLE, PACKED, WHOLE_LAYER = "whole", "packed", "whole layer"  # the other placements (module docstring)
SPLIT_HEAD = "split head"  # a gathered head under sequence or loss parallel (module docstring)
GATHERED = ("colwise_gather_output", "colwise_rep")  # input whole, output gathered whole
SPLIT_INPUT = ("rowwise_split_input", "rowwise_rep")  # whole input split inside, output summed
PACKED_PARTS = {"packed_colwise": 2, "packed_qkv_colwise": 3}
OWN_OUTPUT_HOOK = ("mla_kv_a_proj",)  # a whole layer whose style hooks its output


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def tp_target(model: nn.Module) -> nn.Module:
    """The model whose plan tensor parallel follows: a PeftModel's transformers model (its
    layers are the same modules), else `model`."""
    if is_peft_model(model):
        return model.get_base_model()
    return model


def check_quantized(model: nn.Module, device_type: str) -> None:
    """QLoRA (bitsandbytes 4-/8-bit base weights): ConfigError naming the requirement. Its packed
    integer weights cannot be split by tensor parallel, and bitsandbytes needs CUDA."""
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is None:
        return
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "bitsandbytes":
        return
    bits = "4-bit" if quant.get("load_in_4bit") else "8-bit"
    where = ("bitsandbytes needs a CUDA device, this run is on " + device_type) if device_type != "cuda" else (
        "its packed integer weights cannot be split by tensor parallel")
    raise ConfigError(
        f"{type(model).__name__} has bitsandbytes {bits} base weights (QLoRA) and tensor_parallel_degree > 1: "
        f"{where}; train QLoRA with tensor_parallel_degree: 1 on CUDA, or LoRA on unquantised weights"
    )


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA wrapper (base_layer plus lora_A / lora_B per adapter)."""
    return (hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def adapter_styles(base: str, sequence_parallel: bool = False,
                   parts: int = 1) -> tuple[ParallelStyle | None, ParallelStyle | None]:
    """(lora_A's style, lora_B's style) beside a layer placed as `base` (COLWISE, ROWWISE, WHOLE,
    PACKED with `parts` packed outputs, WHOLE_LAYER); None: left whole (replicated).
    `sequence_parallel`: the base's output is split by sequence. A row-wise base then
    reduce-scatters its output by sequence: lora_A's partial sums are reduce-scattered the same
    way and lora_B, whole, runs on the sequence shard (its gradient summed over the tp ranks, as
    a sequence-parallel norm's); a WHOLE adapter's output is sliced by sequence the same way."""
    if base == COLWISE:  # its input arrives whole, also under sequence parallel
        return None, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))
    if base == PACKED:
        return None, PackedColwise(parts)
    if base == WHOLE:
        return None, ReplicateToSequence() if sequence_parallel else None
    if base == WHOLE_LAYER:
        return None, None
    if sequence_parallel:
        return (RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1), use_local_output=False),
                SequenceParallel(use_local_output=False))
    return RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate()), None


def _layouts(style: ParallelStyle) -> tuple[tuple, tuple, bool] | None:
    """(input layouts, output layouts, use_local_output) of a torch column-/row-wise style (inside
    OwnedOutput); None for any other style."""
    style = style.inner if isinstance(style, OwnedOutput) else style
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return None
    return tuple(style.input_layouts), tuple(style.output_layouts), bool(style.use_local_output)


WHOLE_IN_OUT = ((Replicate(),), (Replicate(),), True)  # whole input, whole plain output
WHOLE_IN_SEQ_OUT = ((Replicate(),), (Shard(SEQ_DIM),), False)  # whole input, output split by sequence
# The output head's layouts under sequence parallel (input), loss parallel (output) or both.
SPLIT_HEAD_LAYOUTS = (
    ((Shard(SEQ_DIM),), (Replicate(),), True),
    ((Replicate(),), (Shard(-1),), False),
    ((Shard(SEQ_DIM),), (Shard(-1),), False),
)


def placement(name: str, style_name: object, base_style: ParallelStyle) -> tuple[str, int, bool]:
    """(how the adapters beside plan entry `name` are placed, packed parts, whether the base's
    output is split by sequence for a WHOLE placement), read off the style's name and checked
    against the layouts of the style built for it; ConfigError where smp places none."""
    base = _base_style_name(style_name)
    if base is not None:
        return base, 1, False
    if style_name in PACKED_PARTS and isinstance(base_style, PackedColwise):
        return PACKED, base_style.parts, False
    if style_name in OWN_OUTPUT_HOOK:
        return WHOLE_LAYER, 1, False
    layouts = _layouts(base_style)
    if style_name in GATHERED and layouts == WHOLE_IN_OUT:
        return WHOLE, 1, False
    if style_name in GATHERED and layouts in SPLIT_HEAD_LAYOUTS:
        return SPLIT_HEAD, 1, False
    if style_name in SPLIT_INPUT and layouts in (WHOLE_IN_OUT, WHOLE_IN_SEQ_OUT):
        return WHOLE, 1, layouts == WHOLE_IN_SEQ_OUT
    why = ("" if style_name not in GATHERED + SPLIT_INPUT else
           f" (here its input and output layouts are {layouts}: smp places adapters beside a gathered layer "
           f"whose input is whole or split by sequence and whose output is whole or split by vocabulary)")
    raise ConfigError(
        f"tensor parallel: {name} carries LoRA adapters and its plan style is {style_name!r}{why}; smp "
        f"places adapters beside 'colwise', 'rowwise', gathered ('colwise_gather_output', "
        f"'rowwise_split_input'), packed ('packed_qkv_colwise', 'packed_colwise') and 'mla_kv_a_proj' "
        f"layers only: leave {name} out of the adapters' target_modules, or out of the tensor-parallel plan"
    )


def head_adapter_styles(base_style: ParallelStyle) -> tuple[ParallelStyle | None, ParallelStyle]:
    """(lora_A's style, lora_B's style) beside a SPLIT_HEAD layer styled `base_style`: lora_B
    column-wise with the head's output layout, taking A's output split by sequence where the
    head's input is; lora_A whole, run sequence-parallel there (module docstring)."""
    (inputs,), (outputs,), use_local_output = _layouts(base_style)  # type: ignore[misc]
    style_b = ColwiseParallel(input_layouts=inputs, output_layouts=outputs, use_local_output=use_local_output)
    if inputs == Replicate():
        return None, style_b
    return SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=False), style_b


def _base_style_name(style: object) -> str | None:
    if style in (COLWISE, ROWWISE):
        return style  # type: ignore[return-value]
    if type(style) is ColwiseParallel:
        return COLWISE
    if type(style) is RowwiseParallel:
        return ROWWISE
    return None


def parallelize_lora(name: str, module: nn.Module, style_name: object, base_style: ParallelStyle,
                     tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split LoRA layer `module` (plan entry `name`, style `style_name`): the base layer by
    `base_style`, each adapter pair by `adapter_styles`."""
    base, parts, seq_out = placement(name, style_name, base_style)
    if getattr(module, "use_dora", {}) and any(module.use_dora.values()):
        raise ConfigError(f"tensor parallel: {name} uses DoRA (use_dora=True), which smp does not split; "
                          f"use plain LoRA or tensor_parallel_degree: 1")
    if len(getattr(module, "lora_embedding_A", {})):
        raise ConfigError(f"tensor parallel: {name} has LoRA embedding adapters, which smp does not split")
    # A whole layer's output hook goes on the LoRA layer: base and adapters share its gradient.
    parallelize_module(module if base == WHOLE_LAYER else module.base_layer, tp_mesh, base_style)
    for adapter in module.lora_A:
        if base == SPLIT_HEAD:
            style_a, style_b = head_adapter_styles(base_style)
        else:
            style_a, style_b = adapter_styles(base, seq_out if base == WHOLE else sequence_parallel, parts)
        if style_a is not None:
            parallelize_module(module.lora_A[adapter], tp_mesh, style_a)
        else:  # whole on every rank: takes the layer's input as a plain tensor (it may come as a DTensor)
            module.lora_A[adapter].register_forward_pre_hook(_local_input)
        if style_b is not None:
            parallelize_module(module.lora_B[adapter], tp_mesh, style_b)


def _local_input(module: nn.Module, args: tuple) -> tuple:
    """A whole (replicated) adapter's input as this rank's plain tensor: a Replicate DTensor's
    local value is the whole input; its gradient goes back as Replicate (the adapter's output
    gradient is already summed over the tp ranks by lora_B's column-wise or packed input, or
    whole where lora_B is whole)."""
    for a in args:
        if isinstance(a, DTensor) and any(not p.is_replicate() for p in a.placements):
            raise ConfigError(f"tensor parallel: a LoRA adapter's input is split ({a.placements}), not whole; "
                              f"smp places adapters beside layers whose input is whole or split by features")
    return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)
