"""Tensor parallel: bytes per rank at TP = 1, 2, 4, and smp vs torch-written TP + FSDP2 step time.

    torchrun --standalone --nproc-per-node 4 bench/bench_tp.py [--steps 10]

One Llama-shaped model (transformers LlamaConfig, same init everywhere), in one run:

1. Memory per rank at tensor_parallel_degree 1, 2, 4 (and with sequence / loss parallel), TP
   alone (no FSDP, which would shard parameters further and hide TP's share):
   - parameter bytes: this rank's local shards;
   - activation bytes: storages saved for backward during one forward (saved-tensor hooks,
     parameter storages left out, each storage counted once, local shards of DTensors).
2. Step time (forward + backward + SGD step) on the 3-D mesh TP=2 x FSDP shard 2, without and
   with sequence parallel: `smp.transform` vs the same plan written with torch alone
   (`parallelize_module` + `fully_shard` per decoder layer and the root), two ways:
   - torchtitan-style: torchtitan's Llama plan (`PrepareModuleInput` on each attention / MLP
     region, so backward reduces each region's input gradient once, as smp does);
   - naive (sequence parallel off only): one style per projection, so backward reduces the
     input gradient once per colwise projection.
   All rows take turns (A B C ..., B C ... A, ...) so machine noise hits all alike; reported:
   the median step time of each, ratios (of medians, and the median of per-round ratios), the
   loss difference (same init, same batches), the collectives of one step (CommDebugMode), and
   a second torchtitan-style copy timed the same way, whose ratio to the first is the noise
   floor of the machine.

Writes bench/results/tp_w{world}.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import smp
from smp.config import load_config
from smp.tensor_parallel import apply_tensor_parallel, loss_parallel
from smp.transform import apply_parallelism
from smp.testing.models import tiny_llama_config

SEED = 0


def build_model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=args.seq,
    ))


def batch(args: argparse.Namespace, step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (rows, args.seq), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s data on this rank (DTensor, async-collective wrappers)."""
    while is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t


def saved_activation_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward."""
    param_ptrs = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        storage = local.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(seen.values())


def memory_case(args: argparse.Namespace, tp: int, sp: bool, lp: bool) -> dict:
    config = {"tensor_parallel_degree": tp, "hybrid_shard_degree": 1,
              "tensor_parallel": {"sequence_parallel": sp, "loss_parallel": lp}}
    smp.init(config)
    try:
        model = build_model(args)
        if tp > 1:
            apply_tensor_parallel(model, smp.state.mesh["tp"], sequence_parallel=sp, loss_parallel=lp)
        params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
        with loss_parallel():  # a no-op unless loss_parallel is on
            acts = saved_activation_bytes(model, batch(args, 0, args.batch))
        return {"tp": tp, "sequence_parallel": sp, "loss_parallel": lp, "param_bytes": params,
                "activation_bytes": acts}
    finally:
        smp.shutdown()


def naive_tp(model: nn.Module, tp_mesh) -> None:
    """Tensor parallel as a user first writes it with torch alone: one style per projection.

    Each colwise projection turns the shared input into its own replicated DTensor, so backward
    all-reduces the input gradient once per projection (q, k, v, gate, up: 11 all-reduces for
    2 layers), not once per region.
    """
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })


def torchtitan_style_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's Llama plan (`apply_tp`) written for transformers' Llama modules.

    `PrepareModuleInput` on self_attn and mlp makes each region's input one replicated DTensor
    that its projections share, so backward reduces the input gradient once per region. HF
    calls self_attn with `hidden_states=` (a keyword) and mlp positionally. Under sequence
    parallel the residual stream stays a Shard(1) DTensor (`use_local_output=False` on the
    layers that close a region), unlike torchtitan's plain local shards: HF builds positions
    and masks from the stream's shape, which must be the full sequence.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    local_stream = not sequence_parallel
    root_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=local_stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    if sequence_parallel:
        root_plan["model.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    for layer in model.model.layers:
        layer_plan = {
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": stream},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=stream, use_local_output=local_stream),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream, use_local_output=local_stream),
        }
        if sequence_parallel:
            layer_plan["input_layernorm"] = SequenceParallel()
            layer_plan["post_attention_layernorm"] = SequenceParallel()
        parallelize_module(layer, tp_mesh, layer_plan)


def fully_shard_layers(model: nn.Module, dp_mesh) -> nn.Module:
    """FSDP2 as smp applies it: one unit per decoder layer, then the root, kept gathered."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def step_collectives(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> dict[str, int]:
    """Collectives of one training step, by op name (DTensor's and FSDP's alike)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        train_step(model, opt, ids)
    return {str(op).rsplit(".", 1)[-1]: n for op, n in sorted(comm.get_comm_counts().items(), key=str)}


def timing_case(args: argparse.Namespace) -> dict:
    smp.init({"tensor_parallel_degree": 2})
    try:
        st = smp.state
        mesh, tp_mesh, dp_mesh = st.mesh, st.mesh["tp"], st.mesh["dp_shard"]
        base = build_model(args)
        sp_config = load_config({"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}})

        def baseline(plan, *plan_args) -> nn.Module:
            model = copy.deepcopy(base)
            plan(model, tp_mesh, *plan_args)
            return fully_shard_layers(model, dp_mesh)

        # Row name -> model. "_again" is a second copy of the same model: its ratio to the first
        # is this machine's noise floor.
        models = {
            "smp": smp.transform(copy.deepcopy(base)),
            "torchtitan_style": baseline(torchtitan_style_tp, False),
            "torchtitan_style_again": baseline(torchtitan_style_tp, False),
            "naive": baseline(naive_tp),
            "smp_sp": apply_parallelism(copy.deepcopy(base), sp_config, st.dims, mesh, st.device),
            "torchtitan_style_sp": baseline(torchtitan_style_tp, True),
        }
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        losses: dict[str, list[float]] = {k: [] for k in models}
        collectives: dict[str, dict[str, int]] = {}
        dp, dp_rank = st.dp_size, st.dp_rank
        for step in range(args.steps + 2):  # step 0 warms up, step 1 counts collectives
            ids = batch(args, step, args.batch * dp)[dp_rank * args.batch:(dp_rank + 1) * args.batch]
            # Rows take turns going first (A B C ..., B C ... A, ...), so that machine noise hits
            # all alike and none always runs on a warmer cache.
            order = list(models)
            order = order[step % len(order):] + order[:step % len(order)]
            for name in order:
                dist.barrier()
                if step == 1:
                    collectives[name] = step_collectives(models[name], opts[name], ids)
                    continue
                t0 = time.perf_counter()
                loss = train_step(models[name], opts[name], ids)
                dist.barrier()
                if step:
                    times[name].append(time.perf_counter() - t0)
                    losses[name].append(loss)
        med = {k: statistics.median(v) for k, v in times.items()}

        def compare(a: str, b: str) -> dict:
            return {
                "ratio": med[a] / med[b],
                # Median of per-step ratios: each pair ran in the same round, so it cancels slow
                # drifts of a shared machine better than the ratio of medians.
                "paired_ratio": statistics.median(x / y for x, y in zip(times[a], times[b])),
                "max_loss_diff": max(abs(x - y) for x, y in zip(losses[a], losses[b])),
            }

        return {
            "mesh": st.dims.describe(),
            "rows": {k: {"step_s": med[k], "collectives_per_step": collectives[k]} for k in models},
            "smp/torchtitan_style": compare("smp", "torchtitan_style"),
            "smp/naive": compare("smp", "naive"),
            "smp_sp/torchtitan_style_sp": compare("smp_sp", "torchtitan_style_sp"),
            "noise_floor": compare("torchtitan_style_again", "torchtitan_style"),
        }
    finally:
        smp.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="rows per data-parallel rank")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    memory = []
    for tp, sp, lp in [(1, False, False), (2, False, False), (2, True, False), (2, True, True),
                       (4, False, False), (4, True, False), (4, True, True)]:
        if world % tp == 0:
            memory.append(memory_case(args, tp, sp, lp))
    timing = timing_case(args) if world % 2 == 0 and world >= 4 else None

    if rank == 0:
        base = memory[0]
        for m in memory:
            m["param_ratio_vs_tp1"] = m["param_bytes"] / base["param_bytes"]
            m["activation_ratio_vs_tp1"] = m["activation_bytes"] / base["activation_bytes"]
            print(f"tp={m['tp']} sp={m['sequence_parallel']!s:5} loss_parallel={m['loss_parallel']!s:5}  params/rank {m['param_bytes'] / 2**20:7.2f} MiB "
                  f"({m['param_ratio_vs_tp1']:.3f})  activations/rank {m['activation_bytes'] / 2**20:7.2f} MiB "
                  f"({m['activation_ratio_vs_tp1']:.3f})")
        if timing:
            print(timing["mesh"])
            for name, row in timing["rows"].items():
                print(f"  {name:24} {row['step_s']:.3f} s/step  collectives/step {row['collectives_per_step']}")
            for pair in ("smp/torchtitan_style", "smp/naive", "smp_sp/torchtitan_style_sp", "noise_floor"):
                c = timing[pair]
                print(f"  {pair:28} ratio {c['ratio']:.3f} (paired {c['paired_ratio']:.3f}), max loss diff {c['max_loss_diff']:.2e}")
        out = Path(__file__).parent / "results" / f"tp_w{world}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "world": world, "memory": memory, "timing": timing}, indent=2))
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
