"""Tensor parallel: bytes per rank at TP = 1, 2, 4, and smp vs hand-written TP + FSDP2 step time.

    torchrun --standalone --nproc-per-node 4 bench/bench_tp.py [--steps 10]

One Llama-shaped model (transformers LlamaConfig, same init everywhere), in one run:

1. Memory per rank at tensor_parallel_degree 1, 2, 4 (and with sequence / loss parallel), TP
   alone (no FSDP, which would shard parameters further and hide TP's share):
   - parameter bytes: this rank's local shards;
   - activation bytes: storages saved for backward during one forward (saved-tensor hooks,
     parameter storages left out, each storage counted once, local shards of DTensors).
2. Step time (forward + backward + SGD step) on the 3-D mesh TP=2 x FSDP shard 2:
   `smp.transform` vs the hand-written `parallelize_module` (same plan: the model's own
   transformers plan, as torch styles) + `fully_shard` per decoder layer and the root.
   Steps rotate between them (A B C, B C A, C A B, ...) so machine noise hits all alike; the
   median step time of each and their ratio (target <= 1.05) are reported, with the loss
   difference of the two (same init, same batches), and a second hand-written copy timed the
   same way, whose ratio to the first is the noise floor of the machine.

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
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import smp
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from smp.tensor_parallel import apply_tensor_parallel, loss_parallel
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
            apply_tensor_parallel(model, smp.state.mesh["tp"], smp.state.config)
        params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
        with loss_parallel():  # a no-op unless loss_parallel is on
            acts = saved_activation_bytes(model, batch(args, 0, args.batch))
        return {"tp": tp, "sequence_parallel": sp, "loss_parallel": lp, "param_bytes": params,
                "activation_bytes": acts}
    finally:
        smp.shutdown()


def hand_written(model: nn.Module, mesh) -> nn.Module:
    """What a user would write with torch alone for the same Llama plan and mesh."""
    tp_mesh = mesh["tp"]
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
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=False)
    return model


def timing_case(args: argparse.Namespace) -> dict:
    smp.init({"tensor_parallel_degree": 2})
    try:
        base = build_model(args)
        ours = smp.transform(copy.deepcopy(base))
        theirs = hand_written(copy.deepcopy(base), smp.state.mesh)
        # A second copy of the hand-written model: the A/A ratio shows this machine's noise floor.
        control = hand_written(copy.deepcopy(base), smp.state.mesh)
        models = {"smp": ours, "hand": theirs, "hand_again": control}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        losses: dict[str, list[float]] = {k: [] for k in models}
        dp, dp_rank = smp.state.dp_size, smp.state.dp_rank
        for step in range(args.steps + 1):  # step 0 warms up
            ids = batch(args, step, args.batch * dp)[dp_rank * args.batch:(dp_rank + 1) * args.batch]
            # Alternate which goes first, so that neither always runs on a warmer cache.
            order = list(models.items())
            order = order[step % len(order):] + order[:step % len(order)]
            for name, model in order:
                dist.barrier()
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opts[name].step()
                opts[name].zero_grad()
                dist.barrier()
                if step:
                    times[name].append(time.perf_counter() - t0)
                    losses[name].append(float(loss))
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "mesh": smp.state.dims.describe(),
            "smp_step_s": med["smp"], "hand_step_s": med["hand"], "ratio": med["smp"] / med["hand"],
            # Median of per-step ratios: each pair ran back to back, so it cancels slow drifts
            # of a shared machine better than the ratio of medians.
            "paired_ratio": statistics.median(a / b for a, b in zip(times["smp"], times["hand"])),
            "control_ratio": med["hand_again"] / med["hand"],
            "control_paired_ratio": statistics.median(a / b for a, b in zip(times["hand_again"], times["hand"])),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["smp"], losses["hand"])),
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
            print(f"{timing['mesh']}: smp {timing['smp_step_s']:.3f} s, hand-written {timing['hand_step_s']:.3f} s, "
                  f"ratio {timing['ratio']:.3f} (paired {timing['paired_ratio']:.3f}); hand-written vs itself "
                  f"{timing['control_ratio']:.3f} (paired {timing['control_paired_ratio']:.3f}), max loss diff {timing['max_loss_diff']:.2e}")
        out = Path(__file__).parent / "results" / f"tp_w{world}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "world": world, "memory": memory, "timing": timing}, indent=2))
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
