"""`smp.transform(model)`: the parallelism recipe, in the order the techniques must compose.

The recipe is RECIPE, a list of named steps (when it applies, what it does) run over the model's
anatomy (smp/anatomy.py), found once; `smp plan` runs the same list on a meta model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from smp import composition, runtime
from smp.activations import apply_activation_checkpointing, apply_activation_offloading
from smp.activations.checkpointing import mode_advice
from smp.anatomy import Anatomy, describe
from smp.compile import apply_compile, check_cuda_graph_layout
from smp.config import ConfigError, MoEConfig, SMPConfig
from smp.context_parallel import apply_context_parallel
from smp.context_parallel.probe import AttentionProbe, install_attention_probe
from smp.expert_parallel import apply_expert_parallel, apply_load_balancing, resolve_ep_plan, shard_experts
from smp.fp8 import apply_fp8, check_fp8_materialized, check_fp8_tp_layers
from smp.mesh import ParallelDims, expert_fsdp_mesh, fsdp_mesh
from smp.pipeline import build_pipeline
from smp.sharding import apply_fsdp, has_meta_tensors, materialize_meta_model
from smp.sharding.batch_norm import refuse_batch_statistics
from smp.sharding.delayed_init import materialize_stages
from smp.sharding.fsdp import block_reshard_after_forward, fsdp_needed, settle_partial_grads, torch_dtype
from smp.sharding.gradient_sync import install_gradient_sync, replicas_by_hook
from smp.sharding.parameter_gather import gather_reshard_after_forward, install_parameter_gather
from smp.tensor_parallel import apply_tensor_parallel
from smp.vision.mixed_batches import install_image_path_on_every_rank


def transform(
    model: nn.Module, *, tp_plan: dict[str, str] | None = None, materialize: bool = True,
    moe_config: MoEConfig | None = None, weights: str | os.PathLike | None = None,
) -> nn.Module:
    """Apply the configured parallelism to `model` in place and return it.

    Build the optimizer after this call, from the returned module's parameters, as with FSDP2.
    With pipeline_parallel_degree > 1 it returns this rank's stages (smp.pipeline.PipelinedModel);
    train it with `smp.step(model, batch)` like any other layout.
    `tp_plan` (module-name pattern -> style) overrides the model's own tensor-parallel plan;
    `moe_config` (smp.expert_parallel.MoEConfig, SMP v2's `transform(model, config=MoEConfig(...))`)
    overrides the config's `moe:` section.
    `weights` (a local Hugging Face safetensors folder) fills the transformed model from it: a
    model built on the meta device is sharded without init and each rank reads only its shards
    (`smp.checkpointing.load_hf`; docs/checkpoints.md).
    """
    st = runtime.current()
    if weights is not None and st.dims.pp == 1:
        from smp.checkpointing.hf import load_hf

        model = apply_parallelism(model, st.config, st.dims, st.mesh, st.device, tp_plan=tp_plan,
                                  materialize=False, moe_config=moe_config)
        load_hf(weights, model, device=torch.device("cpu") if st.config.cpu_offload else st.device)
        return model
    if st.dims.pp == 1:
        from smp.checkpointing.hf import eager_load_note  # the whole model on every rank: say what it cost

        if st.rank == 0 and (note := eager_load_note(model, st.dims.world_size // st.dims.dp_replicate)):
            logging.getLogger("smp").info(note)
        return apply_parallelism(model, st.config, st.dims, st.mesh, st.device, tp_plan=tp_plan,
                                 materialize=materialize, moe_config=moe_config)
    # 0. Pipeline first: the model is split into stages, and each stage of this rank then goes
    #    through the same recipe over its own slice of the mesh.
    cfg = st.config
    if "reshard_after_forward" not in cfg.model_fields_set:
        # Keep each FSDP unit gathered from the first micro-batch's forward to the last one's
        # backward: one all-gather per unit per step instead of two per micro-batch (torchtitan's
        # default under pp), for one unsharded stage's parameters held through the step.
        cfg = cfg.model_copy(update={"reshard_after_forward": False})
    _check_router_loss(model, moe_config or cfg.moe, st.dims.pp)
    # A meta model is split first; each rank then allocates and initialises only its own
    # stages (sharded, after the recipe), or fills them from `weights`.
    anatomy = describe(model)  # the model's parts, found once, before the split takes the layers apart
    layers = anatomy.require_pipeline().layers
    init_device = torch.device("cpu") if cfg.cpu_offload else st.device
    on_meta = has_meta_tensors(model)

    def recipe(stage: nn.Module) -> nn.Module:
        return apply_parallelism(stage, cfg, st.dims, st.mesh, st.device, tp_plan=tp_plan,
                                 materialize=materialize and not on_meta, moe_config=moe_config)

    dp_group = st.mesh["dp"].get_group() if st.dims.dp > 1 else None  # the step's target count is summed over it
    pipelined = build_pipeline(model, cfg.pipeline, st.mesh["pp"].get_group(), st.device, recipe, dp_group, anatomy)
    if weights is not None:
        from smp.checkpointing.hf import load_hf

        load_hf(weights, pipelined, device=init_device)  # each rank reads its stages' tensors only
    elif materialize and on_meta:
        materialize_stages(model, list(pipelined.stages), init_device, cfg.random_seed,
                           stop_at=frozenset(id(m) for m in model.get_submodule(layers)))
        pipelined.copy_tied_values()  # the head's copy of a tied embedding was initialised as a head
    return pipelined


def _check_router_loss(model: nn.Module, moe: MoEConfig, pp: int) -> None:
    """Refuse a model whose loss includes its MoE load-balancing loss under pipeline parallelism:
    the last stage's loss is the cross-entropy of its logits, so the auxiliary loss would be
    dropped, and it multiplies router statistics of every MoE layer (on every stage) over the
    whole batch (every micro-batch), which no stage holds."""
    hf_config = getattr(model, "config", None)
    if not hasattr(hf_config, "output_router_logits"):
        return  # no transformers load-balancing loss (apply_load_balancing says so if one is asked for)
    if moe.moe_load_balancing == "aux_loss" or (moe.moe_load_balancing is None and hf_config.output_router_logits):
        refused = composition.row("aux_loss", "pp")  # the config's own switch is refused by the table alone
        raise ConfigError(
            f"{type(model).__name__} adds a load-balancing loss (config.output_router_logits=True), which "
            f"pipeline_parallel_degree={pp} cannot give exactly: {refused.reason}; {refused.fix}"
        )


@dataclass
class Run:
    """What the recipe's steps share: the run's values, the model's anatomy, and what an earlier
    step leaves for a later one (the context-parallel probe, the blocks)."""

    cfg: SMPConfig
    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    anatomy: Anatomy
    tp_plan: dict[str, str] | None
    moe: MoEConfig
    blocks: list[nn.Module] = field(default_factory=list)
    cp_probe: AttentionProbe | None = None
    fsdp_mesh: DeviceMesh | None = None  # what the FSDP units shard over (None: no units were built)


@dataclass(frozen=True)
class Step:
    name: str
    applies: Callable[[ParallelDims, SMPConfig], bool]
    apply: Callable[[nn.Module, Run], None]


def _fp8(model: nn.Module, run: Run) -> None:
    apply_fp8(model, run.cfg.fp8.recipe, run.cfg.fp8.all_gather)  # Linear -> torchao Float8Linear (smp/fp8.py)


def _fp8_tp_layers(model: nn.Module, run: Run) -> None:
    check_fp8_tp_layers(model)  # a float8 layer under a packed style would scale by its shard (smp/fp8.py)


def _tensor_parallel(model: nn.Module, run: Run) -> None:
    tp = run.cfg.tensor_parallel
    apply_tensor_parallel(model, run.mesh["tp"], run.tp_plan, config_plan=tp.plan, sequence_parallel=tp.sequence_parallel,
                          loss_parallel=tp.loss_parallel, anatomy=run.anatomy)


def _context_parallel(model: nn.Module, run: Run) -> None:
    cp = run.cfg.context_parallel
    run.cp_probe = apply_context_parallel(model, run.mesh["cp"], cp.algorithm, cp.load_balance, tp=run.dims.tp)


def _expert_parallel(model: nn.Module, run: Run) -> None:
    cfg, mp = run.cfg, run.cfg.mixed_precision
    experts = apply_expert_parallel(model, run.mesh["ep"], resolve_ep_plan(model, run.moe.plan), run.moe.capacity_factor)
    shard_experts(
        experts, expert_fsdp_mesh(run.mesh, run.dims),
        param_dtype=torch_dtype(mp.param_dtype), reduce_dtype=torch_dtype(mp.reduce_dtype),
        output_dtype=torch_dtype(mp.output_dtype), cast_forward_inputs=mp.cast_forward_inputs,
        reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload,
    )


def _load_balancing(model: nn.Module, run: Run) -> None:
    dims = run.dims
    apply_load_balancing(
        model, run.mesh["dp"].get_group() if dims.dp > 1 else None, run.moe.moe_load_balancing,
        run.moe.moe_aux_loss_coeff,
        unsupported=(f"context_parallel_degree={dims.cp}: {composition.row('aux_loss', 'cp').reason}"
                     if dims.cp > 1 else None),
    )


def _activation_checkpointing(model: nn.Module, run: Run) -> None:
    ac = run.cfg.activation_checkpointing
    if ac.mode == "selective" and not run.cfg.compile.enabled and run.blocks and _first_rank():
        # Slower than full where the host sets the pace (measured): said with the numbers, once.
        logging.getLogger("smp").warning(mode_advice(ac.mode, compiled=False))
    apply_activation_checkpointing(model, run.blocks, mode=ac.mode, every_n_layers=ac.every_n_layers, save_ops=ac.save_ops)


def _activation_offloading(model: nn.Module, run: Run) -> None:
    cfg = run.cfg
    apply_activation_offloading(model, run.blocks, horizon=cfg.activation_loading_horizon,
                                min_bytes=cfg.activation_offload_min_bytes)


def _compile(model: nn.Module, run: Run) -> None:
    apply_compile(model, run.blocks, run.cfg.compile.backend, cuda_graphs=run.cfg.compile.cuda_graphs)


def _cuda_graph_layout(model: nn.Module, run: Run) -> None:
    """CUDA graphs replay where no FSDP unit was built and no expert routes tokens (the table's
    rows that need the model: smp/composition.py)."""
    check_cuda_graph_layout(run.cfg, model, run.anatomy.experts)


def _fsdp(model: nn.Module, run: Run) -> None:
    """One unit per block, then the root; 1-D over dp_shard when smp's hook, not native HSDP, syncs
    the replicas (gradient_sync.cross_replica). Skipped where it would shard over one rank and
    nothing else needs it (fsdp_needed)."""
    cfg, dims, sync, mp = run.cfg, run.dims, run.cfg.gradient_sync, run.cfg.mixed_precision
    by_hook = replicas_by_hook(sync.cross_replica, dims)
    shard_mesh = fsdp_mesh(run.mesh, dims, by_hook)
    dtypes = dict(param_dtype=torch_dtype(mp.param_dtype), output_dtype=torch_dtype(mp.output_dtype))
    if fsdp_needed(shard_mesh.size(), **dtypes, cpu_offload=cfg.cpu_offload,
                   custom_sync=sync.algorithm != "default" or by_hook):
        reshard = block_reshard_after_forward(
            cfg.reshard_after_forward, explicit="reshard_after_forward" in cfg.model_fields_set,
            shard_ranks=dims.dp_shard * dims.cp, cpu_offload=cfg.cpu_offload)
        # hpZ (parameter_gather.hierarchical): blocks stay sharded over the node after forward.
        reshard = gather_reshard_after_forward(reshard, cfg.parameter_gather.hierarchical, dims.dp_shard * dims.cp)
        apply_fsdp(
            model, shard_mesh, run.blocks, **dtypes, reduce_dtype=torch_dtype(mp.reduce_dtype),
            cast_forward_inputs=mp.cast_forward_inputs, reshard_after_forward=reshard,
            cpu_offload=cfg.cpu_offload, fixed_units=dims.pp > 1 or sync.algorithm != "default" or by_hook
            or cfg.parameter_gather.algorithm != "default" or bool(cfg.parameter_gather.hierarchical)  # units fixed
            # A multimodal model's tower reads a middle layer's output (LLaVA's vision_feature_layer
            # -2): a unit merged over blocks whose outputs go partly unused fails in backward.
            or bool(run.anatomy.towers),
        )
        if isinstance(model, FSDPModule):  # units built (not the one-rank cast layout)
            run.fsdp_mesh = shard_mesh
    elif dims.tp > 1:
        settle_partial_grads(model)


def _image_paths(model: nn.Module, run: Run) -> None:
    """A multimodal model's image path (its vision tower's FSDP units) runs on every rank, also
    where a batch holds no image: otherwise its units all-gather on some ranks only."""
    mesh = run.fsdp_mesh
    if mesh is not None and mesh.size() > 1:
        install_image_path_on_every_rank(model, [mesh.get_group(i) for i in range(mesh.ndim)])


def _batch_norm(model: nn.Module, run: Run) -> None:
    """BatchNorm in training mode would normalise each rank's rows (or tokens) alone: refused
    where the batch is split over data-parallel or context-parallel ranks."""
    refuse_batch_statistics(model, run.dims.dp * run.dims.cp)


def _gradient_sync(model: nn.Module, run: Run) -> None:
    sync = run.cfg.gradient_sync
    by_hook = replicas_by_hook(sync.cross_replica, run.dims)
    install_gradient_sync(
        model, sync.algorithm, block_size=sync.block_size, error_feedback=sync.error_feedback,
        cross_replica=sync.cross_replica, replica_group=run.mesh["dp_replicate"].get_group() if by_hook else None,
    )


def _parameter_gather(model: nn.Module, run: Run) -> None:
    gather, mp = run.cfg.parameter_gather, run.cfg.mixed_precision
    install_parameter_gather(model, gather.algorithm, block_size=gather.block_size,
                             hierarchical=gather.hierarchical, param_dtype=torch_dtype(mp.param_dtype))


def _attention_probe(model: nn.Module, run: Run) -> None:
    """The first forward is replayed on the meta device, refusing attention smp cannot see."""
    install_attention_probe(model, run.cp_probe)


def _first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _always(dims: ParallelDims, cfg: SMPConfig) -> bool:
    return True


# The recipe, in the order the techniques must compose (torchtitan's parallelize). Each step says
# when it applies and what it does; `smp.transform` and `smp plan` run this one list.
RECIPE = (
    Step("fp8", lambda d, c: c.fp8 is not None, _fp8),  # before TP / FSDP wrap the Linear layers (torchtitan's order)
    Step("tensor_parallel", lambda d, c: d.tp > 1, _tensor_parallel),  # first: rewrites the layers the rest wraps
    Step("fp8_tp_layers", lambda d, c: c.fp8 is not None and d.tp > 1, _fp8_tp_layers),  # no shard-local scales
    Step("context_parallel", lambda d, c: d.cp > 1, _context_parallel),  # attention over the cp chunks; wraps nothing
    Step("expert_parallel", lambda d, c: d.ep > 1, _expert_parallel),  # experts split and sharded before blocks are wrapped
    Step("load_balancing", _always, _load_balancing),  # the router loss summed over the data-parallel ranks
    Step("activation_checkpointing", _always, _activation_checkpointing),  # inside FSDP's unshard / reshard
    Step("activation_offloading", lambda d, c: c.activation_offloading, _activation_offloading),
    Step("compile", lambda d, c: c.compile.enabled, _compile),  # per block, after TP and checkpointing
    Step("fsdp", _always, _fsdp),  # last wrapper: one unit per block, then the root
    Step("cuda_graph_layout", lambda d, c: c.compile.cuda_graphs, _cuda_graph_layout),  # once the units are known
    Step("image_paths", _always, _image_paths),  # a VLM's tower units gather on every rank (smp/vision)
    Step("batch_norm", lambda d, c: d.dp * d.cp > 1, _batch_norm),  # batch statistics of one rank's rows refused
    Step("gradient_sync", _always, _gradient_sync),  # smp's collectives on every FSDP unit, when configured
    Step("parameter_gather", _always, _parameter_gather),  # quantised / in-node all-gathers, when configured
    Step("attention_probe", lambda d, c: d.cp > 1, _attention_probe),  # last: its hook runs before FSDP's root one
)


def apply_parallelism(
    model: nn.Module, cfg: SMPConfig, dims: ParallelDims, mesh: DeviceMesh, device: torch.device, *,
    tp_plan: dict[str, str] | None = None, materialize: bool = True, moe_config: MoEConfig | None = None,
) -> nn.Module:
    """`transform` with the state passed in: `cfg` applied over `mesh` (the mesh of `dims`),
    parameters on `device`, by the steps of RECIPE. `smp plan` runs it under a fake process
    group, without smp.init."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"smp.transform expects an nn.Module, got {type(model).__name__}")
    on_meta = has_meta_tensors(model)
    check_fp8_materialized(cfg.fp8 is not None and cfg.fp8.all_gather, on_meta and materialize)
    if not on_meta:
        model.to(device)
    # The model's parts, found once: every step reads this picture (smp/anatomy.py).
    anatomy = describe(model, cfg.shard_modules)
    run = Run(cfg, dims, mesh, device, anatomy, tp_plan, moe_config or cfg.moe, anatomy.block_modules(model))
    for step in RECIPE:
        if step.applies(dims, cfg):
            step.apply(model, run)
    model._smp_transformed = True  # is_transformed(): FSDP's class alone does not say it (skipped over one rank)
    # materialize=False leaves a meta model on meta: shapes and placements only (`smp plan`).
    if on_meta and materialize:
        init_device = "cpu" if cfg.cpu_offload else device
        materialize_meta_model(model, init_device, cfg.random_seed)
    return model


def is_transformed(model: nn.Module) -> bool:
    """Whether `model` went through smp's recipe already (a second pass would wrap it again)."""
    return getattr(model, "_smp_transformed", False)
