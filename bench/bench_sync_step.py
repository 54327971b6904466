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

import torch
import torch.distributed as dist

import smp
import rounds  # bench/ is on sys.path when run as a script

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
    rounds.add_model_arguments(parser, steps_per_round=3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # one process group for all settings (rounds.build_models)
    rank, world = dist.get_rank(), dist.get_world_size()
    settings = HYBRID_SETTINGS if args.hybrid else FLAT_SETTINGS
    cfg = rounds.llama_config(args)
    from transformers import LlamaForCausalLM

    models = rounds.build_models(
        {name: {"hybrid_shard_degree": args.hybrid, "gradient_sync": sync} for name, sync in settings.items()}, cfg)
    params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    timed = rounds.interleaved_rounds(models, args.rounds, args.steps_per_round, args.vocab, args.seq,
                                      smp.gradient_sync_bytes)

    base = timed.median_step_s("default")
    loss = timed.final_loss
    rows = []
    for name in settings:
        med = timed.median_step_s(name)
        rows.append(dict(
            setting=name, step_s=med, vs_default=med / base, nic_tx_bytes_per_step=timed.nic_tx_bytes_per_step(name),
            smp_sync_bytes_per_rank=timed.counted_per_step(name),
            final_loss=loss[name], loss_vs_default=loss[name] / loss["default"] - 1,
        ))
    if rank == 0:
        mbit = rounds.emulated_link_mbit()
        where = f"emulated nodes, {mbit} Mbit/s NICs" if mbit else "one host, loopback"
        print(f"training step, world {world}, hybrid_shard_degree {args.hybrid}, {where}; "
              f"Llama {params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
              f"seq {args.seq}, 1 sequence per data-parallel rank, SGD")
        print(f"{'setting':>20} {'step s':>8} {'x default':>9} {'NIC tx/step':>12} {'smp bytes/rank':>15} {'loss':>8} {'vs default':>10}")
        for r in rows:
            print(f"{r['setting']:>20} {r['step_s']:>8.3f} {r['vs_default']:>9.2f} "
                  f"{rounds.nic_cell(r['nic_tx_bytes_per_step'], 12)} "
                  f"{r['smp_sync_bytes_per_rank']:>15.0f} {r['final_loss']:>8.4f} {100 * r['loss_vs_default']:>+9.3f}%")
        rounds.write_result(f"sync_step_w{world}_h{args.hybrid}", dict(
            world_size=world, hybrid_shard_degree=args.hybrid, **rounds.run_fields(args, params), rows=rows,
        ))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
