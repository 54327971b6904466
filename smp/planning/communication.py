"""Bytes each rank moves per optimizer step, by the bandwidth-optimal collective formulas (ring /
all-gather / reduce-scatter move (n-1)/n of the buffer per rank), for FSDP2 units as
`smp.transform` built them."""

from __future__ import annotations

import torch
from torch import nn

from smp._compat import fsdp_sharded_data
from smp.config import SMPConfig
from smp.mesh import ParallelDims
from smp.planning.memory import dtype_bytes, fsdp_units


def comm_bytes_per_step(model: nn.Module, config: SMPConfig, dims: ParallelDims, *, micro_batch: int = 1,
                        seq_len: int = 0, hidden: int = 0, layers: int = 0, grad_accum: int = 1) -> dict[str, int]:
    """Bytes each rank sends (reduce-scatter, all-reduce) or receives (all-gather) per optimizer
    step, by the bandwidth-optimal formulas, for FSDP2 units as `transform` built them."""
    import smp_collectives as sc

    mp, sync, gather = config.mixed_precision, config.gradient_sync, config.parameter_gather
    all_gather = reduce_scatter = all_reduce = 0
    for module, params in fsdp_units(model):
        is_root = module is model
        n = params[0].mesh_info.shard_mesh_size
        r = getattr(params[0].mesh_info, "replicate_mesh_size", 1)
        if r == 1 and dims.dp_replicate > 1:  # replicas synced by smp's all-reduce hook
            r = dims.dp_replicate
        elems = sum(fsdp_sharded_data(fp).numel() for fp in params) * n  # unsharded, padded
        orig = fsdp_sharded_data(params[0]).dtype
        p_bytes = dtype_bytes(mp.param_dtype, orig)
        g_bytes = dtype_bytes(mp.reduce_dtype, orig)
        # Forward gathers every unit; backward gathers again those resharded after forward
        # (blocks, by config; the root never, see sharding/fsdp.py), over the post-forward
        # group FSDP recorded (smaller than n: parameter_gather.hierarchical).
        all_gather += grad_accum * _unit_gather_bytes(params, is_root, p_bytes, gather.algorithm, gather.block_size)
        if sync.algorithm in ("int8", "fp8"):  # 1-byte codes + a 4-byte scale per block
            reduce_scatter += sc.quantized_bytes(elems, n, sync.block_size)
        else:
            reduce_scatter += sc.fp32_bytes_bound(elems, n, g_bytes)
        if r > 1 and sync.cross_replica in ("int8", "fp8"):  # quantised reduce-scatter + all-gather
            all_reduce += 2 * sc.quantized_bytes(elems // n, r, sync.block_size)
        else:
            all_reduce += 2 * (r - 1) * (elems // n) // r * g_bytes
    out = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce_replicas": all_reduce}
    if dims.tp > 1 and layers:
        # Two activation all-reduces per layer forward (attention, MLP output), two in backward.
        act = micro_batch * seq_len * hidden * dtype_bytes(mp.param_dtype, torch.float32)
        out["tensor_parallel"] = grad_accum * layers * 4 * 2 * (dims.tp - 1) * act // dims.tp
    if dims.cp > 1 and layers:
        # K/V blocks (and their gradients) between the cp ranks, per layer (smp/context_parallel/cost.py).
        from smp.context_parallel.cost import bytes_per_step

        out["context_parallel"] = bytes_per_step(
            config.context_parallel.algorithm, dims.cp, micro_batch, seq_len, _kv_dim(model, hidden), layers,
            recompute=config.activation_checkpointing.mode == "full", grad_accum=grad_accum,
            q_dim=_q_dim(model, hidden),  # Ulysses moves the query heads too
        )
    if dims.ep > 1:
        # Token choices to their experts' ranks and back, per MoE layer (smp/expert_parallel/cost.py).
        from smp.expert_parallel.cost import planned_all_to_all_bytes

        out["expert_all_to_all"] = planned_all_to_all_bytes(
            model, dims.ep, micro_batch * seq_len, hidden, dtype_bytes(mp.param_dtype, torch.float32),
            recompute=config.activation_checkpointing.mode != "none", grad_accum=grad_accum,
        )
    out["total"] = sum(out.values())
    return out


def _unit_gather_bytes(params: list, is_root: bool, p_bytes: int, algorithm: str, block: int,
                       flat: bool = False) -> int:
    """`parameter_gather_bytes` of one FSDP unit as FSDP built it (`flat`: as if its backward
    gather went over every shard rank, not hierarchical)."""
    n = params[0].mesh_info.shard_mesh_size
    cols = sum(fsdp_sharded_data(fp).numel() for fp in params)
    # Forward gathers every unit; backward gathers again those resharded after forward (blocks,
    # by config; the root never, see sharding/fsdp.py), over the post-forward group FSDP
    # recorded (smaller than n: parameter_gather.hierarchical).
    post = params[0].post_forward_mesh_info
    gathers = 1 if is_root or post is None else 2
    node = post.shard_mesh_size if gathers == 2 and post.shard_mesh_size < n and not flat else None
    return parameter_gather_bytes(cols, n, p_bytes, algorithm, block, gathers=gathers, node_ranks=node)


def parameter_gather_settings(model: nn.Module, config: SMPConfig, grad_accum: int = 1,
                              flat: bool = False) -> dict[str, int]:
    """Parameter all-gather bytes per rank per step of `model` (transformed) with each
    `parameter_gather.algorithm`, the units (and hierarchical, unless `flat`) as built."""
    mp, block = config.mixed_precision, config.parameter_gather.block_size
    out = {}
    for algorithm in ("default", "int8", "fp8"):
        total = 0
        for module, params in fsdp_units(model):
            p_bytes = dtype_bytes(mp.param_dtype, fsdp_sharded_data(params[0]).dtype)
            total += _unit_gather_bytes(params, module is model, p_bytes, algorithm, block, flat)
        out[algorithm] = grad_accum * total
    return out


def parameter_gather_bytes(cols: int, n: int, p_bytes: int, algorithm: str, block: int, *, gathers: int,
                           node_ranks: int | None = None) -> int:
    """Bytes one rank sends per step in a unit's parameter all-gathers: `gathers` (1, or 2 when
    resharded after forward) of its `cols`-value shard over `n` ranks, each exact ((n-1) x cols x
    p_bytes) or, for int8 / fp8, (n-1) message rows (codes + 4-byte scales). With `node_ranks`
    (parameter_gather.hierarchical) the backward gather is exact inside the node: (k-1) shards of
    n/k x cols values."""
    from smp_collectives.parameter_gather import gather_bytes

    one = gather_bytes(cols, n, block) if algorithm in ("int8", "fp8") else (n - 1) * cols * p_bytes
    if gathers == 1:
        return one
    if node_ranks is None:
        return 2 * one
    return one + (node_ranks - 1) * (n * cols // node_ranks) * p_bytes


def _q_dim(model: nn.Module, hidden: int) -> int:
    """Query width per token: heads x head dim of a HF config, else the hidden size."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", 0)
    if not heads:
        return hidden
    return heads * (getattr(cfg, "head_dim", None) or hidden // heads)


def _kv_dim(model: nn.Module, hidden: int) -> int:
    """Key (= value) width per token: kv heads x head dim of a HF config, else the hidden size."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", 0)
    if not heads:
        return hidden
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    return (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim


def parameter_gather_note(settings: dict[str, int]) -> str:
    """One line of `smp plan`: the parameter all-gather bytes per step under each setting."""
    base = settings["default"] or 1
    shown = ", ".join(f"{k} {v / 2**20:.1f} MiB ({v / base:.2f}x)" for k, v in settings.items())
    return f"parameter all-gather per rank per step by parameter_gather: {shown} (docs/gradient-sync.md)"
