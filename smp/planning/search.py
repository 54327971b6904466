"""`suggest()`: the smallest tensor-parallel and shard-group degrees whose plan fits a device."""

from __future__ import annotations

from typing import Any

from smp.config import ConfigSource, load_config
from smp.models import resolve_model_config
from smp.planning.memory import GiB
from smp.planning.report import ParallelismPlan, plan


def suggest(config: ConfigSource, model: str | Any, world_size: int, device_memory_gib: float,
            **plan_kwargs: Any) -> tuple[dict[str, int], ParallelismPlan] | None:
    """The smallest (tensor_parallel_degree, hybrid_shard_degree) that fits `device_memory_gib`
    per rank: fewest TP ranks first (TP costs activation traffic on every layer), then the
    smallest shard group (HSDP keeps the all-gathers inside it). None if nothing fits."""
    cfg = load_config(config)
    model_cfg = resolve_model_config(model) if isinstance(model, str) else model
    heads = getattr(model_cfg, "num_key_value_heads", None) or getattr(model_cfg, "num_attention_heads", 1)
    limit = device_memory_gib * GiB
    ep = cfg.expert_parallel_degree
    pp = cfg.pipeline_parallel_degree  # kept as configured: stages come out of the world first
    tp = 1
    # Expert parallelism does not combine with tensor parallel (docs/expert-parallel.md).
    while tp <= (1 if ep > 1 else min(world_size, 64)):
        if world_size % (tp * pp) == 0 and heads % tp == 0:
            dp = world_size // (tp * pp)
            shards = [s for s in (2**i for i in range(dp.bit_length())) if dp % s == 0]
            shards += [dp] if shards[-1] != dp else []  # full shard over every data-parallel rank
            shards = [s for s in shards if s % ep == 0]  # the ep ranks come out of the shard group
            # Memory per rank falls as the shard group grows: binary search for the smallest that fits.
            lo, hi, best = 0, len(shards) - 1, None
            while lo <= hi:
                mid = (lo + hi) // 2
                degrees = {"tensor_parallel_degree": tp, "hybrid_shard_degree": shards[mid] if shards[mid] < dp else 0}
                result = plan(cfg.model_copy(update=degrees), model_cfg, world_size, **plan_kwargs)
                if result.device_bytes <= limit:
                    best, hi = (degrees, result), mid - 1
                else:
                    lo = mid + 1
            if best is not None:
                return best
        tp *= 2
    return None
