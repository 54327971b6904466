"""Expert parallel: all-to-all bytes vs the formula, step time and memory at EP=k vs EP=1.

    torchrun --standalone --nproc-per-node 2 bench/bench_expert_parallel.py [--steps 8]

One Mixtral-shaped model (transformers MixtralConfig, same init everywhere), the same global
batch, in one run:

1. All-to-all bytes each rank sends per step (forward dispatch + return, and the same two in
   backward), counted at smp's exchange (rows that leave the rank x hidden x element bytes),
   vs the formula tokens x top_k x hidden x bytes x (k-1)/k x 4 per MoE layer
   (smp.expert_parallel.cost.all_to_all_bytes_per_step), which assumes even routing.
2. Step time (forward + backward + AdamW step) at expert_parallel_degree = world vs 1 (FSDP
   only over the same ranks), rows taking turns so machine noise hits both alike; medians.
3. Memory per rank: parameter + optimizer state bytes (this rank's shards) at both degrees.
4. Token choices each local expert received per step (smp.expert_parallel.expert_load).

Writes bench/results/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smp
import smp.expert_parallel.dispatch as dispatch_module
from smp.expert_parallel import expert_load
from smp.expert_parallel.cost import all_to_all_bytes_per_step
from smp.testing.distributed import local_rows, local_tensor


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=args.seq, output_router_logits=True,
    ))


class ExchangeCounter:
    """Rows each all-to-all of smp's dispatch sends to other ranks, forward and backward."""

    def __init__(self) -> None:
        self.original = dispatch_module._exchange
        self.sent_bytes = 0

    def __call__(self, t, output_splits, input_splits, group):
        rank = dist.get_rank(group)
        row = t.shape[-1] * t.element_size()  # t: [rows, hidden]
        # Forward sends input_splits; backward sends the gradient the other way: output_splits.
        self.sent_bytes += (sum(input_splits) - input_splits[rank]) * row
        self.sent_bytes += (sum(output_splits) - output_splits[rank]) * row
        return self.original(t, output_splits, input_splits, group)


def run_config(args: argparse.Namespace, ep: int, batch: torch.Tensor, steps: int) -> dict:
    with smp.session({"expert_parallel_degree": ep}):
        model = smp.transform(build(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = local_rows(batch)

        def step() -> float:
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            return time.perf_counter() - start

        step()  # warm-up; also creates the optimizer state
        counter = ExchangeCounter()
        dispatch_module._exchange = counter
        try:
            step()
        finally:
            dispatch_module._exchange = counter.original
        times = [step() for _ in range(steps)]
        param_bytes = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        state_bytes = sum(local_tensor(v).numel() * v.element_size()
                          for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        load = {name: s.tokens_per_expert for name, s in expert_load(model).items()}
        return {"step_s": times, "a2a_sent_bytes": counter.sent_bytes, "param_bytes": param_bytes,
                "optimizer_state_bytes": state_bytes, "tokens_per_local_expert": load}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=torch.Generator().manual_seed(1))
    runs = {ep: run_config(args, ep, batch, args.steps) for ep in (1, world)}
    ep = runs[world]
    tokens = args.global_batch // world * args.seq
    formula = all_to_all_bytes_per_step(tokens, args.top_k, args.hidden, 4, world, args.layers)
    measured = [None] * world
    dist.all_gather_object(measured, ep["a2a_sent_bytes"])
    loads = [None] * world
    dist.all_gather_object(loads, ep["tokens_per_local_expert"])
    mean_sent = statistics.mean(measured)
    result = {
        "args": vars(args), "world": world, "expert_parallel_degree": world,
        "all_to_all": {"sent_bytes_per_rank": measured, "mean": mean_sent, "formula": formula,
                       "ratio": mean_sent / formula},
        "step_s_median": {"ep1": statistics.median(runs[1]["step_s"]), f"ep{world}": statistics.median(ep["step_s"])},
        "memory_per_rank_bytes": {
            "ep1": {"params": runs[1]["param_bytes"], "optimizer_state": runs[1]["optimizer_state_bytes"]},
            f"ep{world}": {"params": ep["param_bytes"], "optimizer_state": ep["optimizer_state_bytes"]},
        },
        "tokens_per_local_expert_per_rank": loads,
    }
    result["step_time_ratio"] = result["step_s_median"][f"ep{world}"] / result["step_s_median"]["ep1"]
    if rank == 0:
        out = Path(__file__).parent / "results" / "expert_parallel.json"
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k != "tokens_per_local_expert_per_rank"}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
