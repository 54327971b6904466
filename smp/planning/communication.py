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

    mp, sync = config.mixed_precision, config.gradient_sync
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
        # (blocks, by config; the root never, see sharding/fsdp.py).
        gathers = 1 + (0 if is_root or config.reshard_after_forward is False else 1)
        all_gather += grad_accum * gathers * (n - 1) * elems // n * p_bytes
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


def _kv_dim(model: nn.Module, hidden: int) -> int:
    """Key (= value) width per token: kv heads x head dim of a HF config, else the hidden size."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", 0)
    if not heads:
        return hidden
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    return (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
