"""Training step time with each `gradient_sync` setting, where the network is the bottleneck.

    # 2 nodes x 2 ranks, shard inside a node, replicate across (HSDP): cross_replica settings
    sudo python bench/emulated_cluster.py --nodes 2 --procs-per-node 2 --link-mbit 1000 -- \
        bench/bench_sync_step.py --hybrid 2
    # 2 nodes x 1 rank, full shard over the link: algorithm settings
    sudo python bench/emulated_cluster.py --nodes 2 --link-mbit 1000 -- bench/bench_sync_step.py

Runs under plain `torchrun` too (then nothing is bandwidth-bound). A Llama with a large
vocabulary and a short batch (gradient bytes large next to the compute, as when fine-tuning on
fast accelerators over a slow inter-node link) is trained through `smp.transform` with each
setting from the same initial weights on the same batches; settings take turns in rounds
(A B C D, A B C D, ...) so that machine noise hits them alike. Reports per setting the median
step time, its ratio to `default`, bytes this node's NIC sent per step (emulated nodes only:
everything on the wire, TCP included) and smp's own counted sync bytes per rank, and the loss
after the last step against `default` (compression must not change training visibly).
Writes bench/results/sync_step_w{N}_h{H}[_emulated{M}mbit].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smp
from emulated_cluster import nic_tx_bytes  # bench/ is on sys.path when run as a script
from smp.testing.models import tiny_llama_config

HYBRID_SETTINGS = {
    "default": {},
    "cross_replica ring": {"cross_replica": "ring"},
    "cross_replica int8": {"cross_replica": "int8"},
    "cross_replica fp8": {"cross_replica": "fp8"},
}
FLAT_SETTINGS = {
    "default": {},
    "ring": {"algorithm": "ring"},
    "int8": {"algorithm": "int8"},
    "fp8": {"algorithm": "fp8"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hybrid", type=int, default=0, help="hybrid_shard_degree (0: full shard)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    # One process group for all settings: smp.init adopts it and smp.shutdown leaves it alone,
    # so each setting only rebuilds the mesh.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    settings = HYBRID_SETTINGS if args.hybrid else FLAT_SETTINGS
    cfg = tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab, max_position_embeddings=args.seq,
    )
    from transformers import LlamaForCausalLM

    models, optims = {}, {}
    for name, sync in settings.items():
        smp.init({"hybrid_shard_degree": args.hybrid, "gradient_sync": sync})
        torch.manual_seed(0)  # the same initial weights for every setting
        model = smp.transform(LlamaForCausalLM(cfg))
        models[name] = (model, smp.state.dp_rank, smp.state.dp_size)
        optims[name] = torch.optim.SGD(model.parameters(), lr=1e-2)
        smp.shutdown()
    # Each model keeps the mesh it was built on: shutdown leaves an adopted process group (and
    # the mesh's subgroups) alone.
    params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())

    times = {name: [] for name in settings}
    nic = {name: [] for name in settings}
    counted = {name: [] for name in settings}
    last_loss = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name in settings:
            model, dp_rank, dp_size = models[name]
            for step in range(args.steps_per_round):
                g = torch.Generator().manual_seed(1000 * rnd + step)
                batch = torch.randint(0, args.vocab, (dp_size, args.seq), generator=g)[dp_rank : dp_rank + 1]
                smp.gradient_sync_bytes(reset=True)
                dist.barrier()
                tx0, t0 = nic_tx_bytes(), time.perf_counter()
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optims[name].step()
                optims[name].zero_grad()
                dist.barrier()
                dt = time.perf_counter() - t0
                if rnd:
                    times[name].append(dt)
                    if tx0 is not None:
                        nic[name].append(nic_tx_bytes() - tx0)
                    counted[name].append(smp.gradient_sync_bytes()["total"])
                last = loss.detach().clone()
                dist.all_reduce(last)
                last_loss[name] = float(last) / world

    base = statistics.median(times["default"])
    rows = []
    for name in settings:
        med = statistics.median(times[name])
        rows.append(dict(
            setting=name, step_s=med, vs_default=med / base,
            nic_tx_bytes_per_step=statistics.median(nic[name]) if nic[name] else None,
            smp_sync_bytes_per_rank=statistics.median(counted[name]),
            final_loss=last_loss[name], loss_vs_default=last_loss[name] / last_loss["default"] - 1,
        ))
    if rank == 0:
        mbit = os.environ.get("SMP_EMULATED_LINK_MBIT")
        where = f"emulated nodes, {mbit} Mbit/s NICs" if mbit else "one host, loopback"
        print(f"training step, world {world}, hybrid_shard_degree {args.hybrid}, {where}; "
              f"Llama {params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
              f"seq {args.seq}, 1 sequence per data-parallel rank, SGD")
        print(f"{'setting':>20} {'step s':>8} {'x default':>9} {'NIC tx/step':>12} {'smp bytes/rank':>15} {'loss':>8} {'vs default':>10}")
        for r in rows:
            nic_s = f"{r['nic_tx_bytes_per_step']:>12.0f}" if r["nic_tx_bytes_per_step"] is not None else f"{'-':>12}"
            print(f"{r['setting']:>20} {r['step_s']:>8.3f} {r['vs_default']:>9.2f} {nic_s} "
                  f"{r['smp_sync_bytes_per_rank']:>15.0f} {r['final_loss']:>8.4f} {100 * r['loss_vs_default']:>+9.3f}%")
        suffix = f"_emulated{mbit}mbit" if mbit else ""
        out = Path(__file__).parent / "results" / f"sync_step_w{world}_h{args.hybrid}{suffix}.json"
        out.write_text(json.dumps(dict(
            world_size=world, hybrid_shard_degree=args.hybrid, emulated_link_mbit=float(mbit) if mbit else None,
            params=params, model=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seq=args.seq),
            rounds=args.rounds, steps_per_round=args.steps_per_round, torch=torch.__version__, rows=rows,
        ), indent=2))
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
