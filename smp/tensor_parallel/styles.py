"""Tensor-parallel styles: the DTensor `ParallelStyle` classes behind a plan's style names
(registry.py maps each name to its class and its facts).

The names are transformers' (`colwise`, `rowwise`, `colwise_gather_output`, `embedding_rowwise`,
`packed_colwise`, ...) so a model's shipped `_tp_plan` is read as is. Most map straight onto
`torch.distributed.tensor.parallel` styles; smp adds three things torch lacks:

* GPT-2's `Conv1D` (weight stored transposed, `(in, out)`): the same styles, sharded on the
  other weight dimension.
* Packed projections (fused q|k|v or gate|up in one weight): each of the `k` packed parts is
  split across ranks (`_StridedShard`), so rank r holds `[q_r | k_r | v_r]` and its heads are
  whole. The matmul runs on local tensors; the input gradient is all-reduced on the way back.
* `RegionEntry`: the entry of an attention/MLP region, taking the residual stream (sequence-
  sharded under sequence parallel) to one replicated DTensor that all the region's projections
  share, so backward reduces the input gradient once per region, not once per projection.

Layouts depend on the options: under sequence parallel the residual stream between regions is a
DTensor sharded on the sequence dim (global shapes, so HF models build masks and positions from
the full sequence); with loss parallel the LM head leaves its logits vocab-sharded.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from smp._compat import apply_style, own_parameters, strided_shard, style_io_functions
from smp.errors import PlanError

SEQ_DIM = 1  # (batch, seq, hidden) everywhere in smp's supported models


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2 family): a Linear whose weight is stored as (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any, src_data_rank: int | None) -> None:
    param = getattr(module, name)
    module.register_parameter(
        name,
        nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad,
        ),
    )


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for `Conv1D`: weight (in, out) sharded on its out dim 1, bias on dim 0."""

    def _partition_conv1d_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute(module, "weight", mesh, Shard(1), self.src_data_rank)
        if module.bias is not None:
            _distribute(module, "bias", mesh, Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        prepare_input, prepare_output = style_io_functions(self)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(prepare_input, self.input_layouts, self.desired_input_layouts),
            partial(prepare_output, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for `Conv1D`: weight (in, out) sharded on its in dim 0, bias replicated."""

    def _partition_conv1d_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute(module, "weight", mesh, Shard(0), self.src_data_rank)
        if module.bias is not None:
            _distribute(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        prepare_input, prepare_output = style_io_functions(self)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(prepare_input, self.input_layouts, self.desired_input_layouts),
            partial(prepare_output, self.output_layouts, self.use_local_output),
        )


@contextmanager
def _local_params(module: nn.Module, convert: dict[str, Any] | None = None) -> Iterator[None]:
    """Run `module`'s own forward on the local shards of its DTensor parameters.

    `to_local()` is differentiable: gradients flow back into the DTensor parameters with their
    own placements. Reads `_parameters` at call time, so FSDP's unsharded parameters are used.
    """
    slots = own_parameters(module)
    saved = dict(slots)
    nf = getattr(module, "nf", None)
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                to_local = (convert or {}).get(name, DTensor.to_local)
                slots[name] = to_local(p)  # type: ignore[assignment]
        if is_conv1d(module):  # Conv1D views its output to (..., nf): the local width here
            module.nf = slots["weight"].shape[1]
        yield
    finally:
        slots.update(saved)
        if nf is not None:
            module.nf = nf


class PackedColwise(ParallelStyle):
    """Column-wise split of a packed projection (`parts` outputs fused in one weight).

    Rank r keeps part_i's r-th slice for every part i, e.g. `[q_r | k_r | v_r]` for a fused qkv
    (parts=3) or `[gate_r | up_r]` (parts=2). The module's output is that local concatenation,
    so the code reading it must use per-rank sizes (smp divides head counts / split sizes).

    Layouts chosen so that FSDP can shard on top and `full_tensor()` / checkpoints still give the
    original (unpermuted) weight:
      * weight: `_StridedShard(out_dim, parts)` on TP; FSDP then shards the *other* dim
        (`fsdp_shard_placement`), since splitting a strided-local dim again has no DTensor layout.
      * bias: replicated (out features, tiny); each rank reads its slices. Its gradient is
        Partial over TP (each rank fills its own slices) and DTensor sums it.
    """

    def __init__(self, parts: int = 2):
        super().__init__()
        self.parts = parts

    def _partition(self, module: nn.Module, mesh: DeviceMesh) -> None:
        out_dim = 1 if is_conv1d(module) else 0
        _distribute(module, "weight", mesh, strided_shard(out_dim, self.parts), self.src_data_rank)
        module.weight._smp_fsdp_shard_dim = 1 - out_dim  # type: ignore[attr-defined]
        if getattr(module, "bias", None) is not None:
            _distribute(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise NotImplementedError(f"packed colwise supports nn.Linear and Conv1D, not {type(module).__name__}")
        self._partition(module, device_mesh)
        original_forward = module.forward
        parts, tp, rank = self.parts, device_mesh.size(), device_mesh.get_local_rank()

        def local_bias(bias: DTensor) -> torch.Tensor:
            full = bias.to_local(grad_placements=[Partial()])
            n = full.shape[0] // parts // tp
            return torch.cat([p[rank * n:(rank + 1) * n] for p in full.chunk(parts)])

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            if tuple(x.placements) != (Replicate(),):
                x = x.redistribute(placements=[Replicate()])
            # Each rank's input gradient covers only its own slice of outputs: declared Partial,
            # DTensor all-reduces it to Replicate in backward.
            x = x.to_local(grad_placements=[Partial()])
            with _local_params(module, {"bias": local_bias}):
                return original_forward(x, *args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        return module


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """`fully_shard(shard_placement_fn=...)`: the dim FSDP shards a TP parameter on, when not 0."""
    dim = getattr(param, "_smp_fsdp_shard_dim", None)
    return None if dim is None else Shard(dim)


class RegionEntry(ParallelStyle):
    """Entry of an attention/MLP region: its input becomes one replicated DTensor shared by all
    of the region's projections.

    Sharing matters for backward: each colwise projection's input gradient is a partial sum,
    and with one shared DTensor they add up first and are reduced once per region (an
    all-reduce, or under sequence parallel a reduce-scatter back to the sequence shards)
    instead of once per projection. `input_layout` is how a plain tensor input is laid out:
    Shard(seq) under sequence parallel, else Replicate. Takes the first positional argument,
    else `hidden_states=` (how HF layers call attention).

    Why not torch's `PrepareModuleInput`, which issues the same collectives (torchtitan's plan
    uses it; bench/bench_tp.py counts both): it needs each region's call convention up front,
    `input_layouts` with exactly as many entries as positional arguments (else ValueError), or
    `input_kwarg_layouts` by keyword name. That is in the parent's code, not the module's: HF
    Llama/Qwen2 call attention with `hidden_states=` only, GPT-2 attention and every MLP with one
    positional argument, so one static PrepareModuleInput cannot cover the regions smp finds in
    any model; this style picks the argument at call time.
    """

    def __init__(self, input_layout: Placement):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def enter(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.input_layout], run_check=False)
            return x.redistribute(placements=[Replicate()])

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (enter(args[0]),) + tuple(args[1:]), kwargs
            if "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=enter(kwargs["hidden_states"]))
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ReplicateToSequence(ParallelStyle):
    """A module left whole whose output joins the sequence-sharded stream (GPT-2's position
    embedding): parameters become Replicate DTensors, the output a Shard(1) DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    name, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False), p.requires_grad)
                )

        def to_input(_mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
                for t in inputs
            )

        def to_output(_mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> DTensor:
            # Shard(SEQ_DIM) of a (1, seq, h) or (b, seq, h) tensor: a slice, no communication.
            return out.redistribute(placements=[Shard(SEQ_DIM)])

        return distribute_module(module, device_mesh, partition, to_input, to_output)


class ReplicatedPartialGrad(ParallelStyle):
    """`replicated_with_grad_allreduce`: a parameter kept whole on every rank whose gradient
    each rank computes only partly, e.g. Qwen3's per-head `q_norm` inside attention, which
    sees only this rank's heads. transformers sums such gradients over the TP group; here the
    module runs on its parameters' local values with the gradient declared `Partial`, so
    DTensor (or FSDP, before its reduce-scatter) sums it: no hook to lose when FSDP replaces
    the parameters. `grad_placement` is a class attribute so a test can break the sum on
    purpose (tests/tensor_parallel/tp_vocabulary_cases.py)."""

    grad_placement: Placement = Partial()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                _distribute(module, name, device_mesh, Replicate(), self.src_data_rank)
        grad_placement = self.grad_placement

        def local_partial(p: DTensor) -> torch.Tensor:
            return p.to_local(grad_placements=[grad_placement])

        original_forward = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            convert = {name: local_partial for name in own_parameters(module)}
            with _local_params(module, convert):
                return original_forward(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        return module


class LocalParams(ParallelStyle):
    """`local_params`: a split attention module's own bare per-head parameters (GPT-OSS-style
    attention sinks, Beam's `gate_bias`), which have no forward of their own to hook. Each is
    named by its own plan entry ('colwise': split on dim 0, by head, like the rows of the
    colwise q projection), so rank r holds the entries of exactly its heads; the module's
    forward then runs on the local shards. Each rank computes the whole gradient of its own
    heads' entries (the rowwise output projection already summed what follows), so the
    gradient stays a Shard: nothing to sum. `placement` is a class attribute so that a test can
    misalign the split with the heads on purpose (tests/tensor_parallel/tp_local_params_cases.py)."""

    placement: Placement = Shard(0)

    def __init__(self, param_names: tuple[str, ...]):
        super().__init__()
        self.param_names = param_names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.param_names:
            _distribute(module, name, device_mesh, self.placement, self.src_data_rank)
        original_forward = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            with _local_params(module):
                return original_forward(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        return module


class WholeSequence(ParallelStyle):
    """Under sequence parallel, a block that computes on the whole sequence with plain tensors:
    the MoE block around `moe_tp_experts` (router, unsplit shared expert) or a submodule the plan
    leaves replicated (DeepSeek-V3's attention). It takes the sequence-sharded stream in as one
    gathered plain tensor (whose gradient is whole on every rank: partial gradients inside are
    summed there) and hands its output back as a sequence shard."""

    def __init__(self, seq_dim: int):
        super().__init__()
        self.seq_dim = seq_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        seq = Shard(self.seq_dim)

        def enter(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [seq], run_check=False)
            return x.redistribute(placements=[Replicate()]).to_local()

        gathered: list[torch.Size] = []  # the (batch, seq) of the latest input, for post_hook

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                args = (enter(args[0]),) + tuple(args[1:])
                first = args[0]
            elif "hidden_states" in kwargs:
                kwargs = dict(kwargs, hidden_states=enter(kwargs["hidden_states"]))
                first = kwargs["hidden_states"]
            else:
                return args, kwargs
            if isinstance(first, torch.Tensor):
                gathered[:] = [first.shape[:self.seq_dim + 1]]
            return args, kwargs

        def leave(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).redistribute(placements=[seq])

        def per_token(x: Any) -> bool:
            return isinstance(x, torch.Tensor) and bool(gathered) and x.shape[:self.seq_dim + 1] == gathered[0]

        def post_hook(_mod: nn.Module, _args: tuple, out: Any) -> Any:
            # (hidden_states, router_logits) in MoE families: router logits are flat (tokens,
            # experts) and stay whole for the aux loss. Every other output laid out per token like
            # the input (DeepSeek-V4's hyper-connection: post, comb, collapsed) rejoins the stream.
            if isinstance(out, tuple):
                return (leave(out[0]),) + tuple(leave(o) if per_token(o) else o for o in out[1:])
            return leave(out)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook)
        return module


class ReplicateParams(ParallelStyle):
    """Under sequence parallel, a module outside every region, norm and embedding that owns
    parameters (HRM's `z_L_init`, added to the stream; DeepSeek-V4's `hc_head`, mixing the final
    streams): its parameters become Replicate DTensors, so that its own code combines them with
    the sequence-sharded stream through DTensor, which places every result (and sums every
    gradient) itself. Inputs and outputs are left as they come."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                _distribute(module, name, device_mesh, Replicate(), self.src_data_rank)
        return module


class _Owned(torch.autograd.Function):
    """Identity whose output the caller owns: DTensor's `to_local()` hands back a view made
    inside an autograd Function, which autograd forbids modifying in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # same storage, no copy; not marked as a view of x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class OwnedOutput(ParallelStyle):
    """`inner` (a style whose module returns a plain local tensor), with that output one the
    caller may modify in place: Llama-4's MoE block does `out = shared_expert(x); out.add_(...)`
    on its rowwise-closed shared expert. No copy: the tensor is the all-reduce's fresh result."""

    def __init__(self, inner: ParallelStyle):
        super().__init__()
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.inner.src_data_rank = self.src_data_rank
        module = apply_style(self.inner, module, device_mesh)

        def own(_mod: nn.Module, _args: tuple, out: Any) -> Any:
            return _Owned.apply(out) if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else out

        module.register_forward_hook(own)
        return module


class MlaKvAProj(ParallelStyle):
    """`mla_kv_a_proj`: the joint down-projection `kv_a_proj_with_mqa` of DeepSeek-V2-style
    multi-head latent attention (MLA), kept whole on every rank. Its output is
    [latent | k_rope]: the latent goes through a norm into the colwise `kv_b_proj`, whose input
    gradient DTensor sums over the TP ranks; k_rope, one rotary key slice shared by every head,
    goes straight into this rank's heads, so each rank's gradient for it covers its heads only.
    Here that slice is summed over the TP group in backward (transformers' `_AllReduceBackward`
    on the same slice); everything else stays a plain tensor. The region holding it gets no
    shared DTensor entry (tp_plan.py), so its other whole modules (`q_a_proj`, the latent norms)
    run on plain tensors too. `rope_grad_placement` is a class attribute so a test can break the
    sum on purpose (tests/tensor_parallel/tp_mla_cases.py)."""

    rope_grad_placement: Placement = Partial()

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim, grad_placement = self.rope_dim, self.rope_grad_placement

        def sum_rope_grad(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            latent, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
            # Identity forward; backward: this rank's partial gradient, all-reduced.
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([latent, rope.to_local(grad_placements=[grad_placement])], dim=-1)

        module.register_forward_hook(sum_rope_grad)
        return module


class ShardSequenceAtEntry(ParallelStyle):
    """`shard_sequence`: under sequence parallel, the language model inside a multimodal model
    (LLaVA's `model.language_model`). Its wrapper embeds the tokens and scatters the image
    features in before calling it with `inputs_embeds`, so the stream cannot be sharded at the
    embedding: those whole embeddings enter the sequence-sharded stream here (a slice on each
    rank; backward all-gathers their gradient, whole on every rank like the vision tower's)."""

    def __init__(self, seq_dim: int, where: str):
        super().__init__()
        self.seq_dim, self.where = seq_dim, where

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        seq, where = Shard(self.seq_dim), self.where

        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x = kwargs.get("inputs_embeds")
            if not isinstance(x, torch.Tensor):
                raise PlanError(
                    f"sequence_parallel: {where!r} (the language model smp shards the sequence for) was "
                    "called without `inputs_embeds`; smp enters the sequence shards where the multimodal "
                    "model hands its embeddings to the language model. Call it with inputs_embeds, or set "
                    "tensor_parallel.sequence_parallel: false"
                )
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).redistribute(placements=[seq])
            return args, dict(kwargs, inputs_embeds=x)

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module
