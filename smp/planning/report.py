"""`plan()`: the per-rank memory and communication of a config for a model at N ranks, as a
`ParallelismPlan` report (text for people, a dict for JSON)."""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from smp import scope
from smp.checkpointing.hf.read import load_host_bytes
from smp.config import ConfigError, ConfigSource, load_config
from smp.mesh import ParallelDims
from smp.models import build_causal_lm, resolve_model_config
from smp.planning.activations import activation_bytes, saved_activation_bytes
from smp.planning.communication import comm_bytes_per_step, parameter_gather_note, parameter_gather_settings
from smp.planning.experts import expert_account, find_experts
from smp.planning.fake_world import fake_world
from smp.planning.memory import (
    OPTIMIZER_STATE_FACTOR,
    dtype_bytes,
    fsdp_units,
    human_bytes,
    optimizer_state_bytes,
    sharded_bytes,
    transient_bytes,
)
from smp.activations.checkpointing import mode_advice
from smp.sharding.fsdp import block_reshard_after_forward, cast_transient_bytes, describe_layout


@dataclass
class ParallelismPlan:
    world_size: int
    rank: int
    mesh: str
    micro_batch: int
    seq_len: int
    optimizer: str
    # Per-rank bytes on the training device (host when cpu_offload / activation offloading).
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int  # gathered parameters of the largest units + their unsharded gradients
    host_bytes: int  # what offloading keeps in host memory instead
    comm_bytes: dict[str, int] = field(default_factory=dict)  # per rank per optimizer step
    pipeline: dict[str, Any] = field(default_factory=dict)  # pipeline_parallel_degree > 1: `_plan_pipeline`; {} without
    experts: dict[str, int] = field(default_factory=dict)  # MoE models: `experts.expert_account`; {} if dense
    flops_per_token: float = 0.0
    total_params: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # Host bytes per rank while the weights load: {"weights": transform(weights=), "eager": from_pretrained first}.
    load_host_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes + self.transient_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device_bytes": self.device_bytes}

    def format(self) -> str:
        g = human_bytes
        lines = [
            f"plan for rank {self.rank} of {self.world_size}: {self.mesh}",
            f"model: {self.total_params / 1e6:,.1f} M parameters, {self.flops_per_token / 1e9:,.3f} GFLOP/token "
            f"at seq {self.seq_len}; micro-batch {self.micro_batch} per rank; optimizer {self.optimizer}",
            "per-rank device memory:",
            f"  parameters         {g(self.param_bytes)}",
            f"  gradients          {g(self.grad_bytes)}",
            f"  optimizer state    {g(self.optimizer_bytes)}",
            f"  activations        {g(self.activation_bytes)}",
            f"  transient buffers  {g(self.transient_bytes)}",
            f"  total              {g(self.device_bytes)}",
        ]
        if self.host_bytes:
            lines.append(f"  host (offloaded)   {g(self.host_bytes)}")
        if self.experts:
            e = self.experts
            lines += [
                f"experts: {e['moe_layers']} MoE layers x {e['num_experts']} experts, top-{e['top_k']}, "
                f"expert_parallel_degree {e['expert_parallel_degree']}",
                f"  expert parameters  {e['params_total']:,} in the model, {e['params_ep_rank']:,} per ep rank "
                f"(1/{e['expert_parallel_degree']}), {e['params_this_rank']:,} on this rank (FSDP over {e['fsdp_shard_size']})",
                f"  expert param bytes {g(e['param_bytes_this_rank'])}  (part of parameters above)",
            ]
        if self.pipeline:
            pl = self.pipeline
            lines += [
                f"pipeline: {pl['schedule']}, pp {pl['pp']}, {pl['microbatches']} micro-batches of {pl['microbatch_rows']} "
                f"row(s), {pl['num_stages']} stages; this rank (pp rank {pl['pp_rank']}) holds stage(s) "
                f"{', '.join(str(s['index']) for s in pl['stages'])}",
            ]
            for s in pl["stages"]:
                lines.append(f"  stage {s['index']} ({s['layers']}): {s['params']:,} parameters, activations "
                             f"{g(s['activation_bytes_per_microbatch']).strip()} per micro-batch x at most "
                             f"{s['microbatches_held']} held")
            formula = "" if pl["bubble_formula"] is None else f"; formula {pl['bubble_formula']:.3f}"
            lines.append(f"  bubble: {pl['bubble']:.3f} of the step on this rank (schedule order, "
                         f"T_F = T_I = T_W){formula}: {pl['bubble_formula_source']}")
            lines.append(f"  point-to-point per step: sends {g(pl['p2p_send_bytes']).strip()}, receives "
                         f"{g(pl['p2p_recv_bytes']).strip()} ({pl['p2p_boundary_bytes']:,} B per micro-batch "
                         f"per boundary and direction)")
        if self.load_host_bytes:
            lines.append(f"host memory while loading: {g(self.load_host_bytes['weights']).strip()} per rank with "
                         f"smp.transform(meta model, weights=FOLDER); {g(self.load_host_bytes['eager']).strip()} "
                         "(the whole model) with from_pretrained on every rank before smp.transform")
        lines.append("communication per rank per step:")
        for key, value in self.comm_bytes.items():
            lines.append(f"  {key:<18} {g(value)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan(config: ConfigSource, model: str | Any, world_size: int, *, rank: int = 0, seq_len: int = 2048,
         micro_batch: int = 1, optimizer: str = "adamw", grad_accum: int = 1) -> ParallelismPlan:
    """The per-rank plan of `config` for `model` (a named shape, a local folder, or a
    transformers config) at `world_size` ranks, seen from `rank`.

    Runs smp's real recipe (`apply_parallelism`, what `smp.transform` calls) on a meta model as
    `rank` of a fake world of `world_size`, over a mesh built here: smp.init is never called, so
    the caller's process (its generators, any smp state) is left as it was.
    """
    from smp.metrics import model_flops
    from smp.sharding import find_blocks
    from smp.sharding.blocks import root_modules
    from smp.transform import apply_parallelism

    start = time.perf_counter()
    cfg = load_config(config)
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ConfigError(f"optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE_FACTOR)}")
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError("--batch and --seq-len must be at least 1")
    dims = ParallelDims.from_config(cfg, world_size)  # degree errors before anything is built
    # A copy: transform may edit the model's config (activation checkpointing turns off use_cache).
    model_cfg = resolve_model_config(model) if isinstance(model, str) else copy.deepcopy(model)
    p_bytes = dtype_bytes(cfg.mixed_precision.param_dtype, torch.float32)
    g_bytes = dtype_bytes(cfg.mixed_precision.reduce_dtype, torch.float32)
    if dims.pp > 1:
        return _plan_pipeline(cfg, dims, model_cfg, world_size, rank=rank, seq_len=seq_len, micro_batch=micro_batch,
                              optimizer=optimizer, grad_accum=grad_accum, p_bytes=p_bytes, g_bytes=g_bytes,
                              start=start)

    # A scope of its own: the recipe's session objects (the context-parallel setup over the fake
    # world's group) go with the fake world, and an open session's are left as they were.
    with fake_world(world_size, rank), scope.isolated("smp plan"):
        mesh, _ = dims.build_mesh("cpu")  # the mesh smp.init builds on gloo; meta tensors never use it
        with torch.device("meta"):
            meta_model = build_causal_lm(model_cfg)
        # Activations first: one forward of the still unsharded model at this rank's micro-batch.
        blocks = find_blocks(meta_model, cfg.shard_modules)
        root_names, root_share = root_modules(meta_model, blocks)  # what stays in the root unit
        experts = find_experts(meta_model, cfg, dims.ep)
        compute = p_bytes if cfg.mixed_precision.param_dtype else None
        # Under context parallel a rank holds seq_len / cp tokens of each sequence.
        local_seq = seq_len // dims.cp
        outside, per_block = saved_activation_bytes(meta_model, micro_batch, local_seq, blocks, compute)
        hidden = getattr(model_cfg, "hidden_size", 0)
        block_input = micro_batch * local_seq * hidden * (compute or 4)
        flops = model_flops(meta_model)
        total_params = sum(p.numel() for p in meta_model.parameters())
        whole = _whole_bytes(meta_model)
        # Then the real recipe, left on meta.
        apply_parallelism(meta_model, cfg, dims, mesh, torch.device("cpu"), materialize=False)
        sizes = _stage_sizes(meta_model)  # FSDP's shards; whole parameters where no FSDP unit holds them
        comm = comm_bytes_per_step(
            meta_model, cfg, dims, micro_batch=micro_batch, seq_len=seq_len, hidden=hidden,
            layers=len(per_block), grad_accum=grad_accum,
        )
        reshard = block_reshard_after_forward(
            cfg.reshard_after_forward, explicit="reshard_after_forward" in cfg.model_fields_set,
            shard_ranks=dims.dp_shard * dims.cp, cpu_offload=cfg.cpu_offload)
        transient = transient_bytes(meta_model, p_bytes, g_bytes, all_gathered=reshard is False) \
            if fsdp_units(meta_model) else cast_transient_bytes(meta_model, p_bytes)
        layout = describe_layout(meta_model)  # FSDP units, merged or none (sharding/fsdp.py)
        top_k = getattr(model_cfg, "num_experts_per_tok", None) or 1
        expert_figures = expert_account(meta_model, experts, dims.ep, top_k)

    act_device, act_host, notes = activation_bytes(cfg, outside, per_block, block_input, dims.tp)
    shown = ", ".join(root_names[:8]) + (f" ... ({len(root_names) - 8} more)" if len(root_names) > 8 else "")
    notes.append(f"root FSDP unit (gathered for the whole step, never checkpointed): {shown}: "
                 f"{root_share:.1%} of the parameters")
    notes += [layout] if layout else []
    advice = mode_advice(cfg.activation_checkpointing.mode, cfg.compile.enabled)  # eager vs compiled
    notes += [advice] if advice else []
    notes.append(parameter_gather_note(parameter_gather_settings(meta_model, cfg, grad_accum)))
    if dims.ep > 1:
        notes.append(f"expert parallel assumes balanced routing: a rank's experts receive tokens x top_k choices "
                     f"(activations) and each choice leaves the rank with probability {dims.ep - 1}/{dims.ep} "
                     "(expert_all_to_all); the dispatch's own buffers are not counted")
    params, grads = sizes["padded"], sizes["padded"]
    opt = optimizer_state_bytes(optimizer, sizes)
    host = act_host
    if cfg.cpu_offload:
        host += params + grads + opt
        params = grads = opt = 0
        notes.append("cpu_offload: parameters, gradients and optimizer state are in host memory")
    return ParallelismPlan(
        world_size=world_size, rank=rank, mesh=dims.describe(), micro_batch=micro_batch, seq_len=seq_len,
        optimizer=optimizer, param_bytes=params, grad_bytes=grads, optimizer_bytes=opt,
        activation_bytes=act_device, transient_bytes=transient, host_bytes=host, comm_bytes=comm,
        experts=expert_figures,
        flops_per_token=flops.per_token(seq_len), total_params=total_params,
        seconds=time.perf_counter() - start, notes=notes, load_host_bytes=load_host_bytes(*whole, sizes["local"]),
    )


def _plan_pipeline(cfg: Any, dims: ParallelDims, model_cfg: Any, world_size: int, *, rank: int, seq_len: int,
                   micro_batch: int, optimizer: str, grad_accum: int, p_bytes: int, g_bytes: int,
                   start: float) -> ParallelismPlan:
    """The plan under pipeline_parallel_degree > 1: this rank's stages, split and transformed as
    `smp.transform` does it (on meta, over the fake world), the activations the schedule holds
    and the point-to-point bytes it sends (planning/pipeline.py)."""
    from smp.config import SPLIT_BACKWARD_SCHEDULES, check_pipeline
    from smp.metrics import model_flops
    from smp.planning.pipeline import plan_stages
    from smp.transform import apply_parallelism

    try:
        check_pipeline(cfg.pipeline, dims.pp, batch_size=micro_batch)
    except ValueError as e:
        raise ConfigError(f"{e} (--batch is the rows one smp.step takes per data-parallel rank)") from None
    if "reshard_after_forward" not in cfg.model_fields_set:  # what transform does under pp
        cfg = cfg.model_copy(update={"reshard_after_forward": False})
    microbatches = cfg.pipeline.microbatches or dims.pp * cfg.pipeline.local_stages()
    rows = micro_batch // microbatches
    hidden = getattr(model_cfg, "hidden_size", 0)
    compute = p_bytes if cfg.mixed_precision.param_dtype else None
    with fake_world(world_size, rank), scope.isolated("smp plan"):
        mesh, _ = dims.build_mesh("cpu")
        with torch.device("meta"):
            meta_model = build_causal_lm(model_cfg)
        flops = model_flops(meta_model)
        total_params = sum(p.numel() for p in meta_model.parameters())
        whole = _whole_bytes(meta_model)
        pp_group = mesh["pp"].get_group()
        pp_rank = mesh["pp"].get_local_rank()

        def recipe(stage: Any) -> Any:
            return apply_parallelism(stage, cfg, dims, mesh, torch.device("cpu"), materialize=False)

        fig = plan_stages(meta_model, cfg, pp_group, pp_rank, rows=rows, seq_len=seq_len, hidden=hidden,
                          compute_bytes=compute, recipe=recipe)
        pipelined = fig["pipelined"]
        params = grads = opt = transient = held = 0
        comm: dict[str, int] = {}
        for stage in pipelined.stages:
            sizes = _stage_sizes(stage)
            held += sizes["local"]
            params += sizes["padded"]
            grads += sizes["padded"]
            opt += optimizer_state_bytes(optimizer, sizes)
            transient += transient_bytes(stage, p_bytes, g_bytes, all_gathered=cfg.reshard_after_forward is False)
            # FSDP inside a stage: one all-gather per unit per step (reshard_after_forward false),
            # one reduce-scatter (PipelineStage skips it for every micro-batch but the last).
            for key, value in comm_bytes_per_step(stage, cfg, dims, grad_accum=grad_accum).items():
                comm[key] = comm.get(key, 0) + value

    notes: list[str] = []
    act_by_stage: dict[int, int] = {}
    for index, counted in fig["per_mb"].items():
        act, _, stage_notes = activation_bytes(cfg, counted["outside"], counted["per_block"],
                                               rows * seq_len * hidden * (compute or 4), dims.tp)
        act_by_stage[index] = act
        notes += [n for n in stage_notes if n not in notes]
    from smp.planning.pipeline import held_activation_peak

    peak, most = held_activation_peak(fig["order"][pp_rank], act_by_stage)
    sim = fig["simulated"]
    formula, source = fig["formula"]
    p2p = fig["p2p"][pp_rank]
    comm.pop("total", None)
    comm["pipeline_p2p_send"] = grad_accum * p2p["send"]
    comm["total"] = sum(comm.values())
    stages = [
        {"index": info.index, "layers": info.describe().split(": ", 1)[1].split(";")[0], "params": info.params,
         "flops_per_token": info.flops_per_token, "activation_bytes_per_microbatch": act_by_stage[info.index],
         "microbatches_held": most.get(info.index, 0)}
        for info in pipelined.stage_infos
    ]
    pipeline = {
        "schedule": cfg.pipeline.schedule, "pp": dims.pp, "pp_rank": pp_rank, "microbatches": fig["microbatches"],
        "microbatch_rows": rows, "num_stages": fig["num_stages"], "stages": stages,
        "split": [s.describe() for s in pipelined.split],
        "bubble": sim["bubble"][pp_rank], "bubble_per_rank": [sim["bubble"][r] for r in sorted(sim["bubble"])],
        "bubble_formula": formula, "bubble_formula_source": source,
        "p2p_send_bytes": p2p["send"], "p2p_recv_bytes": p2p["recv"], "p2p_boundary_bytes": fig["boundary_bytes"],
        "p2p_per_rank": [fig["p2p"][r] for r in sorted(fig["p2p"])],
    }
    notes.append("pipeline activations: each micro-batch's saved tensors are held from its forward to its backward "
                 "(to its weight-gradient step under the zero-bubble / V schedules); torch's receive buffers and "
                 "the stage outputs kept for backward are not counted")
    if cfg.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
        notes.append(f"{cfg.pipeline.schedule} splits the backward: measured runs hold more activations than "
                     "this figure (seen 19-26% more on a small Llama at pp 2; docs/pipeline-parallel.md)")
    host = 0
    if cfg.cpu_offload:
        host, params, grads, opt = params + grads + opt, 0, 0, 0
        notes.append("cpu_offload: parameters, gradients and optimizer state are in host memory")
    return ParallelismPlan(
        world_size=world_size, rank=rank, mesh=dims.describe(), micro_batch=micro_batch, seq_len=seq_len,
        optimizer=optimizer, param_bytes=params, grad_bytes=grads, optimizer_bytes=opt, activation_bytes=peak,
        transient_bytes=transient, host_bytes=host, comm_bytes=comm, pipeline=pipeline,
        flops_per_token=flops.per_token(seq_len), total_params=total_params,
        seconds=time.perf_counter() - start, notes=notes, load_host_bytes=load_host_bytes(*whole, held),
    )


def _whole_bytes(model: Any) -> tuple[int, int]:
    """(bytes of the whole model's parameters and buffers, the largest one's), each tensor once."""
    sizes = [t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()]
    return sum(sizes), max(sizes, default=0)


def _stage_sizes(stage: Any) -> dict[str, int]:
    """`sharded_bytes` of a stage; a stage FSDP left alone (one rank per stage) holds its
    parameters whole (local shards of tensor-parallel DTensors)."""
    from smp.planning.memory import fsdp_units

    if fsdp_units(stage):
        return sharded_bytes(stage)
    from torch.distributed.tensor import DTensor

    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in stage.parameters()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    return {"padded": total, "local": total, "count": len(tensors)}
