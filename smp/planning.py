"""Per-rank memory and communication plan, computed by running `smp.transform` for real.

`plan(config, model, world_size)` joins a *fake* process group (torch's FakeStore / "fake"
backend: collectives are no-ops) as one rank of a world of N, builds the model on the meta
device, and runs `smp.transform` on it without materialising. What FSDP2 and tensor parallel
then hold per rank is read from the sharded parameters themselves (padding included), so the
plan follows the exact placement code a real run uses, at any world size, in seconds and with
no memory: a 1024-rank plan of an 8B model runs on a laptop.

Parameters, gradients and optimizer state come from the shards; activations from one forward
and backward of the unsharded meta model at the per-rank micro-batch, counting the tensors
autograd saves (then adjusted for checkpointing / offloading / tensor parallel: see
`_activation_bytes`); communication from the bandwidth-optimal collective formulas (ring /
all-gather / reduce-scatter move (n-1)/n of the buffer per rank).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from smp.config import ConfigError, ConfigSource, SMPConfig, canonical_dtype, load_config
from smp.mesh import ParallelDims

GiB = 1024**3

# Named model shapes (transformers Llama configs: no download, built from numbers).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # CPU demo / tests: 2 layers of width 64, byte-level vocabulary.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048),
    # Llama 3.2 1B shape (tied embeddings).
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, head_dim=64, tie_word_embeddings=True,
                     max_position_embeddings=131072, rope_theta=500000.0),
    # Llama 3.1 8B shape.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                     rope_theta=500000.0),
    # Llama 3.1 70B shape.
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0),
}

# Optimizer state per parameter element, in units of the parameter's own size.
OPTIMIZER_STATE_FACTOR = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


class ModelSpecError(ValueError):
    """A --model that names no known shape and no usable local folder."""


def resolve_model_config(spec: str, **overrides: Any):
    """A transformers config from a named shape (`MODEL_SHAPES`), a local model folder holding
    config.json, or a config.json file. Never touches the network."""
    from transformers import AutoConfig, LlamaConfig

    if spec in MODEL_SHAPES:
        return LlamaConfig(**{**MODEL_SHAPES[spec], **overrides})
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSpecError(
                f"model folder {spec!r} has no config.json; point --model at a folder saved with "
                f"save_pretrained (config.json + weights), or use a named shape: {', '.join(MODEL_SHAPES)}"
            )
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    elif path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ModelSpecError(f"{spec!r} has no 'model_type' key; is it a transformers config.json?")
        config = AutoConfig.for_model(**data)
    else:
        raise ModelSpecError(
            f"--model {spec!r} is neither a named shape ({', '.join(MODEL_SHAPES)}) nor an existing "
            f"local folder with a config.json"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_causal_lm(config) -> nn.Module:
    """A randomly initialised causal LM of the config's architecture (in the current device context)."""
    from transformers import AutoModelForCausalLM

    # sdpa: the fused attention a real run uses (and `_FusedAttention` models when planning).
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


# ----------------------------------------------------------------------------------------------
# The fake world


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as `rank` of a world of `world_size`, over torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "smp plan needs a process without a process group (it joins a fake one of the planned "
            "size); run it from the command line (`smp plan`) or before smp.init"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings():
            # The fake backend has no timeouts to set; smp.init's attempt is harmless here.
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _rng_untouched() -> Iterator[None]:
    """smp.init seeds every generator; a plan made inside a user's process must not reseed it."""
    import random

    py_state = random.getstate()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:
        np, np_state = None, None
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)
    if np is not None:
        np.random.set_state(np_state)


# ----------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
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
    flops_per_token: float = 0.0
    total_params: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

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
        lines.append("communication per rank per step:")
        for key, value in self.comm_bytes.items():
            lines.append(f"  {key:<18} {g(value)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:10.3f} {unit}"
    return f"{n:10.0f} B  "


def _dtype_bytes(name: str | None, default: torch.dtype) -> int:
    if name is None:
        return torch.empty((), dtype=default).element_size() if default != torch.bool else 1
    return torch.empty((), dtype=getattr(torch, canonical_dtype(name)), device="meta").element_size()


def _fsdp_units(model: nn.Module) -> list[tuple[nn.Module, list[Any]]]:
    """(module, its FSDPParams) for every FSDP unit of a transformed model."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                units.append((module, list(group.fsdp_params)))
    return units


def sharded_bytes(model: nn.Module) -> dict[str, int]:
    """Per-rank bytes of a transformed model's sharded parameters: "padded" (what FSDP allocates
    for parameters and gradients) and "local" (the unpadded shards, which optimizer state copies)."""
    padded = local = count = 0
    for _, params in _fsdp_units(model):
        for fp in params:
            elem = fp._sharded_param_data.element_size()
            padded += fp._sharded_param_data.numel() * elem
            local += math.prod(fp.sharded_size) * elem
            count += 1
    return {"padded": padded, "local": local, "count": count}


def _unit_elems(model: nn.Module) -> tuple[int, int]:
    """Unsharded (padded) elements of the root unit and of the largest block unit."""
    root = block = 0
    for module, params in _fsdp_units(model):
        elems = sum(fp._sharded_param_data.numel() for fp in params) * params[0].mesh_info.shard_mesh_size
        if module is model:
            root = elems
        else:
            block = max(block, elems)
    return root, block


def comm_bytes_per_step(model: nn.Module, config: SMPConfig, dims: ParallelDims, *, micro_batch: int = 1,
                        seq_len: int = 0, hidden: int = 0, layers: int = 0, grad_accum: int = 1) -> dict[str, int]:
    """Bytes each rank sends (reduce-scatter, all-reduce) or receives (all-gather) per optimizer
    step, by the bandwidth-optimal formulas, for FSDP2 units as `transform` built them."""
    import smp_collectives as sc

    mp, sync = config.mixed_precision, config.gradient_sync
    all_gather = reduce_scatter = all_reduce = 0
    for module, params in _fsdp_units(model):
        is_root = module is model
        n = params[0].mesh_info.shard_mesh_size
        r = getattr(params[0].mesh_info, "replicate_mesh_size", 1)
        if r == 1 and dims.dp_replicate > 1:  # replicas synced by smp's all-reduce hook
            r = dims.dp_replicate
        elems = sum(fp._sharded_param_data.numel() for fp in params) * n  # unsharded, padded
        orig = params[0]._sharded_param_data.dtype
        p_bytes = _dtype_bytes(mp.param_dtype, orig)
        g_bytes = _dtype_bytes(mp.reduce_dtype, orig)
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
        act = micro_batch * seq_len * hidden * _dtype_bytes(mp.param_dtype, torch.float32)
        out["tensor_parallel"] = grad_accum * layers * 4 * 2 * (dims.tp - 1) * act // dims.tp
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------------------------
# Activations


class _FusedAttention(torch.autograd.Function):
    """Stands in for scaled_dot_product_attention while counting: what a fused (flash /
    memory-efficient) kernel saves, q, k, v, output and the row log-sum-exp, and no seq x seq
    matrix (on the meta device SDPA would otherwise take the unfused math path)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _FusedAttention.apply(q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _saved_activation_bytes(model: nn.Module, micro_batch: int, seq_len: int, blocks: list[nn.Module],
                            compute_bytes: int | None) -> tuple[int, list[int]]:
    """(bytes autograd saves outside the blocks, bytes saved inside each block) for one
    forward of the (meta) model; parameters and their views are not activations."""
    param_ids = {id(p) for p in model.parameters()}
    block_index: list[int | None] = [None]
    per_block = [0] * len(blocks)
    outside = [0]
    seen: list[torch.Tensor] = []  # keep the tensors alive so ids stay unique
    seen_ids: set[int] = set()

    def pack(t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if id(base) in param_ids or id(base) in seen_ids:
            return t
        seen_ids.add(id(base))
        seen.append(base)
        elem = base.element_size()
        if compute_bytes is not None and base.is_floating_point():
            elem = compute_bytes
        nbytes = base.numel() * elem
        if block_index[0] is None:
            outside[0] += nbytes
        else:
            per_block[block_index[0]] += nbytes
        return t

    def enter(i: int):
        def hook(*_: Any) -> None:
            block_index[0] = i
        return hook

    def leave(*_: Any) -> None:
        block_index[0] = None

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(leave))
    try:
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _fused_attention():
            # use_cache=True: without a cache transformers inspects position ids for packed
            # sequences with a data-dependent branch, which meta tensors cannot take.
            out = model(input_ids=ids, labels=ids, use_cache=True)
        del out
    finally:
        for h in handles:
            h.remove()
    return outside[0], per_block


def _activation_bytes(config: SMPConfig, outside: int, per_block: list[int], block_input: int,
                      tp: int) -> tuple[int, int, list[str]]:
    """(device bytes, host bytes, notes) of activations under checkpointing / offloading / TP."""
    notes = []
    ac = config.activation_checkpointing
    # Under tensor parallel each rank holds 1/tp of a block's head and MLP activations; the
    # norm and residual tensors are replicated unless sequence parallel splits them too.
    per_block = [b // tp for b in per_block] if tp > 1 else list(per_block)
    if tp > 1:
        notes.append("activations under tensor parallel: block activations divided by tp (approximate)")
    kept = []
    recompute_peak = 0
    for i, b in enumerate(per_block):
        if ac.mode == "full" and i % ac.every_n_layers == 0:
            kept.append(block_input)  # only the block's input survives until backward
            recompute_peak = max(recompute_peak, b)  # one block is rebuilt at a time
        else:
            kept.append(b)
    if ac.mode == "selective":
        notes.append("selective checkpointing: activations shown without it (an upper bound)")
    host = 0
    if config.sm_activation_offloading:
        # Saved tensors of the blocks go to host; `activation_loading_horizon` blocks come back
        # ahead of backward.
        horizon = config.activation_loading_horizon
        on_device = sorted(kept, reverse=True)[:horizon]
        host = sum(kept) - sum(on_device)
        kept = on_device
    return outside + sum(kept) + recompute_peak, host, notes


# ----------------------------------------------------------------------------------------------


def plan(config: ConfigSource, model: str | Any, world_size: int, *, rank: int = 0, seq_len: int = 2048,
         micro_batch: int = 1, optimizer: str = "adamw", grad_accum: int = 1) -> Plan:
    """The per-rank plan of `config` for `model` (a named shape, a local folder, or a
    transformers config) at `world_size` ranks, seen from `rank`."""
    from smp import runtime
    from smp.metrics import model_flops
    from smp.sharding import find_blocks
    from smp.transform import transform

    start = time.perf_counter()
    cfg = load_config(config)
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ConfigError(f"optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE_FACTOR)}")
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError("--batch and --seq-len must be at least 1")
    dims = ParallelDims.from_config(cfg, world_size)  # degree errors before anything is built
    # A copy: transform may edit the model's config (activation checkpointing turns off use_cache).
    model_cfg = resolve_model_config(model) if isinstance(model, str) else copy.deepcopy(model)
    if runtime.is_initialized():
        raise RuntimeError("smp plan cannot run inside an smp job: call it before smp.init")

    with fake_world(world_size, rank), _rng_untouched():
        state = runtime.init(cfg)
        try:
            with torch.device("meta"):
                meta_model = build_causal_lm(model_cfg)
            # Activations first: one forward of the still unsharded model at this rank's micro-batch.
            blocks = find_blocks(meta_model, cfg.shard_modules)
            compute = _dtype_bytes(cfg.mixed_precision.param_dtype, torch.float32) if cfg.mixed_precision.param_dtype else None
            outside, per_block = _saved_activation_bytes(meta_model, micro_batch, seq_len, blocks, compute)
            hidden = getattr(model_cfg, "hidden_size", 0)
            block_input = micro_batch * seq_len * hidden * (compute or 4)
            flops = model_flops(meta_model)
            total_params = sum(p.numel() for p in meta_model.parameters())
            # Then the real recipe, left on meta.
            transform(meta_model, materialize=False)
            sizes = sharded_bytes(meta_model)
            comm = comm_bytes_per_step(
                meta_model, cfg, state.dims, micro_batch=micro_batch, seq_len=seq_len, hidden=hidden,
                layers=len(per_block), grad_accum=grad_accum,
            )
            root_elems, block_elems = _unit_elems(meta_model)
        finally:
            runtime.shutdown()

    act_device, act_host, notes = _activation_bytes(cfg, outside, per_block, block_input, dims.tp)
    p_bytes = _dtype_bytes(cfg.mixed_precision.param_dtype, torch.float32)
    g_bytes = _dtype_bytes(cfg.mixed_precision.reduce_dtype, torch.float32)
    # The root stays gathered for the whole step (reshard_after_forward=False, sharding/fsdp.py);
    # two blocks are gathered at once (the one computing and the one prefetched); one unit's
    # unsharded gradient waits for its reduce-scatter.
    transient = (root_elems + 2 * block_elems) * p_bytes + max(root_elems, block_elems) * g_bytes
    params, grads = sizes["padded"], sizes["padded"]
    opt = OPTIMIZER_STATE_FACTOR[optimizer] * sizes["local"]
    if optimizer.startswith("adam"):
        opt += 4 * sizes["count"]  # each parameter's step counter: a float32 scalar
    host = act_host
    if cfg.cpu_offload:
        host += params + grads + opt
        params = grads = opt = 0
        notes.append("cpu_offload: parameters, gradients and optimizer state are in host memory")
    return Plan(
        world_size=world_size, rank=rank, mesh=dims.describe(), micro_batch=micro_batch, seq_len=seq_len,
        optimizer=optimizer, param_bytes=params, grad_bytes=grads, optimizer_bytes=opt,
        activation_bytes=act_device, transient_bytes=transient, host_bytes=host, comm_bytes=comm,
        flops_per_token=flops.per_token(seq_len), total_params=total_params,
        seconds=time.perf_counter() - start, notes=notes,
    )


def suggest(config: ConfigSource, model: str | Any, world_size: int, device_memory_gib: float,
            **plan_kwargs: Any) -> tuple[dict[str, int], Plan] | None:
    """The smallest (tensor_parallel_degree, hybrid_shard_degree) that fits `device_memory_gib`
    per rank: fewest TP ranks first (TP costs activation traffic on every layer), then the
    smallest shard group (HSDP keeps the all-gathers inside it). None if nothing fits."""
    cfg = load_config(config)
    model_cfg = resolve_model_config(model) if isinstance(model, str) else model
    heads = getattr(model_cfg, "num_key_value_heads", None) or getattr(model_cfg, "num_attention_heads", 1)
    limit = device_memory_gib * GiB
    tp = 1
    while tp <= min(world_size, 64):
        if world_size % tp == 0 and heads % tp == 0:
            dp = world_size // tp
            shards = [s for s in (2**i for i in range(dp.bit_length())) if dp % s == 0]
            shards += [dp] if shards[-1] != dp else []  # full shard over every data-parallel rank
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
