"""smp.transform vs hand-written FSDP2 on the same model and mesh, side by side in one run.

    torchrun --standalone --nproc-per-node 2 bench/bench_fsdp.py [--hybrid 0] [--steps 20]

Both models start from the same init and take the same batches; steps alternate between them
(A, B, A, B, ...) so that machine noise hits both alike. Reports the median step time of each
and their ratio (target <= 1.02), and the model-state bytes per rank (parameters + gradients +
AdamW state) against total / shard degree (target <= 1.05). Writes bench/results/fsdp_w{N}.json.
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import smp
from smp.testing.models import tiny_llama_config


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += local(v).numel() * v.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hybrid", type=int, default=0, help="hybrid_shard_degree")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = parser.parse_args()

    torch.set_num_threads(1)
    smp.init({"hybrid_shard_degree": args.hybrid})
    st = smp.state
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=2048, max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())

    smp_model = smp.transform(copy.deepcopy(base))

    # The hand-written equivalent a user would write for the same mesh.
    hand_model = copy.deepcopy(base)
    mesh = st.mesh[("dp_replicate", "dp_shard")] if st.dims.dp_replicate > 1 else st.mesh["dp_shard"]
    for layer in hand_model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(hand_model, mesh=mesh, reshard_after_forward=False)

    models = {"smp": smp_model, "fsdp2": hand_model}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    gen = torch.Generator().manual_seed(st.dp_rank)
    for step in range(args.steps + 3):
        batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
        for name, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optims[name].step()
            if step == args.steps + 2:
                times[name + "_state_bytes"] = model_state_bytes(model, optims[name])
            optims[name].zero_grad()
            dist.barrier()
            if step >= 3:  # warm-up steps excluded
                times[name].append(time.perf_counter() - t0)

    med = {k: statistics.median(times[k]) for k in models}
    shard = st.dims.dp_shard
    result = {
        "world_size": st.world_size,
        "mesh": st.dims.describe(),
        "model": f"Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch {args.batch}/rank",
        "steps": args.steps,
        "smp_step_s": med["smp"],
        "fsdp2_step_s": med["fsdp2"],
        "step_time_ratio": med["smp"] / med["fsdp2"],
        "model_state_bytes_per_rank": times["smp_state_bytes"],
        "hand_fsdp2_state_bytes_per_rank": times["fsdp2_state_bytes"],
        # params + grads + 2 AdamW moments = 4 x parameter bytes, over the shard degree
        "ideal_bytes_per_rank": 4 * full_bytes / shard,
        "bytes_ratio": times["smp_state_bytes"] / (4 * full_bytes / shard),
    }
    if st.rank == 0:
        out = Path(__file__).parent / "results" / f"fsdp_w{st.world_size}_h{args.hybrid}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    smp.shutdown()


if __name__ == "__main__":
    main()
