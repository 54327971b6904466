"""Training step time with each `parameter_gather` setting, beside `gradient_sync` int8 on and off,
where the network is the bottleneck.

    # 2 nodes x 2 ranks, full shard over all 4 (every gather crosses the link)
    python bench/emulated_cluster.py --nodes 2 --procs-per-node 2 --link-mbit 1000 -- \
        bench/bench_parameter_gather.py
    python bench/emulated_cluster.py --nodes 2 --procs-per-node 2 --link-mbit 10000 -- \
        bench/bench_parameter_gather.py
    # HSDP: 2 replicas x 4 shards on 4 nodes x 2 ranks (each replica's gathers cross 2 nodes;
    # hierarchical keeps the backward gather in the node)
    python bench/emulated_cluster.py --nodes 4 --procs-per-node 2 --link-mbit 1000 -- \
        bench/bench_parameter_gather.py --hybrid-shard 4

Runs under plain `torchrun` too (then nothing is bandwidth-bound). A Llama with a large
vocabulary and a short batch, bf16 parameters (FSDP all-gathers bf16), is trained through
`smp.transform` with each setting from the same initial weights on the same batches; settings
take turns in rounds so that machine noise hits them alike. Reports per setting the median step
time and its ratio to `default`, bytes this node's NIC sent per step (emulated nodes: everything
on the wire), parameter all-gather bytes per rank per step (counted by smp_collectives; the
default gather by the plan's formula, which the tests check against counted bytes) and their
ratio to bf16, and the loss after the last step against `default`.
Writes bench/results/param_gather_w{N}[_hsdp{R}x{S}][_n{nodes}x{ranks}][_emulated{M}mbit].json.

    python bench/bench_parameter_gather.py --throughput   # Q / D of the CPU path, break-even
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import smp
import rounds  # bench/ is on sys.path when run as a script
from smp.planning.communication import comm_bytes_per_step, parameter_gather_settings
from smp.sharding.parameter_gather import parameter_gather_bytes

# name -> (parameter_gather, gradient_sync)
SETTINGS = {
    "default": ({}, {}),
    "gather int8": ({"algorithm": "int8"}, {}),
    "gather int8 hier": ({"algorithm": "int8", "hierarchical": True}, {}),
    "sync int8": ({}, {"algorithm": "int8"}),
    "gather+sync int8": ({"algorithm": "int8"}, {"algorithm": "int8"}),
    "gather hier+sync int8": ({"algorithm": "int8", "hierarchical": True}, {"algorithm": "int8"}),
}
# Under HSDP (--hybrid-shard) also the replicas' all-reduce in int8 (smp's hook syncs them; FSDP's
# mesh is then each replica's shard axis alone).
REPLICA_SETTINGS = {
    "gather+sync int8 +repl": ({"algorithm": "int8"}, {"algorithm": "int8", "cross_replica": "int8"}),
    "gather hier+sync int8 +repl": ({"algorithm": "int8", "hierarchical": True},
                                    {"algorithm": "int8", "cross_replica": "int8"}),
}


def throughput(cols: int = 2**21, n: int = 4, block: int = 256, repeats: int = 7) -> None:
    """Q and D of the gather's CPU path (values/s, one thread, bf16 shards) and the break-even
    link rate per rank they give (docs/gradient-sync.md); no process group needed."""
    from smp_collectives import parameter_gather as PG

    torch.set_num_threads(1)
    x = torch.randn(cols).bfloat16()
    for kind in ("int8", "fp8"):
        message = torch.empty(n, PG.message_width(cols, block), dtype=torch.uint8)
        for r in range(n):
            PG.encode_shard(x, block, kind, message[r], impl="torch")
        out = torch.empty(n * cols, dtype=torch.bfloat16)
        rate = {}
        for name, run, values in (
            ("encode", lambda: PG.encode_shard(x, block, kind, message[0], impl="torch"), cols),
            ("decode", lambda: PG.decode_message(message, cols, block, kind, out, impl="torch"), n * cols),
        ):
            run()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            rate[name] = values / statistics.median(times)
        q, d = rate["encode"], rate["decode"]
        for ranks in (2, 4, 8):
            b = 0.98 * (ranks - 1) / ranks / (1 / (ranks * q) + 1 / d)
            print(f"{kind} N={ranks}: Q {q / 1e6:.0f} M values/s, D {d / 1e6:.0f} M values/s -> "
                  f"pays below {b * 8 / 1e9:.2f} Gbit/s per rank")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--throughput", action="store_true", help="only Q / D of the CPU path, no ranks")
    rounds.add_model_arguments(parser, steps_per_round=2)
    parser.add_argument("--only", nargs="*", default=None, help="settings to run (default: all)")
    parser.add_argument("--hybrid-shard", type=int, default=0,
                        help="HSDP: hybrid_shard_degree (ranks each replica shards over; 0: full shard over all)")
    args = parser.parse_args()
    if args.throughput:
        return throughput()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shard = args.hybrid_shard or world
    table = {**SETTINGS, **REPLICA_SETTINGS} if args.hybrid_shard else SETTINGS
    settings = {k: v for k, v in table.items() if args.only is None or k in args.only or k == "default"}
    if local >= shard:  # each shard group inside one node: hierarchical has nothing to keep there (smp refuses it)
        settings = {k: v for k, v in settings.items() if "hier" not in k}
    layout = {"hybrid_shard_degree": args.hybrid_shard} if args.hybrid_shard else {}
    cfg = rounds.llama_config(args)
    from transformers import LlamaForCausalLM

    planned, bf16_same_units = {}, {}

    def plan(name: str, model: torch.nn.Module) -> None:
        planned[name] = comm_bytes_per_step(model, smp.state.config, smp.state.dims)["all_gather"]
        # The exact bf16 gather of the same FSDP units, flat (FSDP may group units differently
        # when nothing custom is installed, so the default row's units can differ).
        bf16_same_units[name] = parameter_gather_settings(model, smp.state.config, flat=True)["default"]

    models = rounds.build_models({
        name: {"mixed_precision": {"param_dtype": "bf16"}, "parameter_gather": gather, "gradient_sync": sync, **layout}
        for name, (gather, sync) in settings.items()
    }, cfg, inspect=plan)
    params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    timed = rounds.interleaved_rounds(models, args.rounds, args.steps_per_round, args.vocab, args.seq,
                                      parameter_gather_bytes)

    base = timed.median_step_s("default")
    bf16_gather = planned["default"]
    loss = timed.final_loss
    rows = []
    for name, (gather, sync) in settings.items():
        med = timed.median_step_s(name)
        # Counted where smp's comm gathers; FSDP2's own (default, flat) by the plan's formula.
        gathered = timed.counted_per_step(name) if gather else planned[name]
        rows.append(dict(
            setting=name, parameter_gather=gather, gradient_sync=sync, step_s=med, vs_default=med / base,
            speedup=base / med, nic_tx_bytes_per_step=timed.nic_tx_bytes_per_step(name),
            all_gather_bytes_per_rank=gathered, all_gather_vs_bf16=gathered / bf16_same_units[name],
            all_gather_vs_default_row=gathered / bf16_gather, bf16_gather_same_units=bf16_same_units[name],
            planned_all_gather=planned[name], final_loss=loss[name],
            loss_vs_default=loss[name] / loss["default"] - 1,
        ))
    if rank == 0:
        mbit = rounds.emulated_link_mbit()
        where = f"emulated nodes ({world // local} x {local} ranks), {mbit} Mbit/s NICs" if mbit else "one host, loopback"
        shape = f"HSDP {world // shard} x {shard}" if args.hybrid_shard else "full shard"
        print(f"training step, world {world} {shape}, {where}; Llama {params / 1e6:.1f}M params (hidden "
              f"{args.hidden}, {args.layers} layers, vocab {args.vocab}), bf16 params, seq {args.seq}, 1 sequence "
              f"per rank, SGD; {args.rounds} rounds x {args.steps_per_round} steps")
        print(f"{'setting':>27} {'step s':>8} {'speedup':>8} {'NIC tx/step':>12} {'gather B/rank':>14} "
              f"{'x bf16':>7} {'loss':>8} {'vs default':>10}")
        for r in rows:
            print(f"{r['setting']:>27} {r['step_s']:>8.3f} {r['speedup']:>8.2f} "
                  f"{rounds.nic_cell(r['nic_tx_bytes_per_step'], 12)} "
                  f"{r['all_gather_bytes_per_rank']:>14.0f} {r['all_gather_vs_bf16']:>7.3f} {r['final_loss']:>8.4f} "
                  f"{100 * r['loss_vs_default']:>+9.3f}%")
        stem = f"param_gather_w{world}"
        if args.hybrid_shard:
            stem += f"_hsdp{world // shard}x{shard}"
        if (world // local, local) != (2, 2):  # the 2 x 2 nodes' files keep their first names
            stem += f"_n{world // local}x{local}"
        rounds.write_result(stem, dict(
            world_size=world, ranks_per_node=local, hybrid_shard_degree=args.hybrid_shard,
            **rounds.run_fields(args, params), rows=rows,
        ))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
