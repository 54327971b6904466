"""Context parallel: activation memory per rank, longest sequence in a memory budget, load
balance, bytes moved and step time, on a Llama-shaped model (fp32, CPU gloo ranks).

    python bench/bench_context_parallel.py [--seq 2048] [--budget-mib 64] [--steps 5]

1. Saved-activation bytes per rank at cp = 1, 2, 4 (world = cp, one sequence, context parallel
   attention applied with `apply_context_parallel` and no FSDP, so that parameters stay out of
   the count): inside the decoder blocks (attention + MLP) and in total; goal: within 10% of 1/cp.
2. Longest sequence whose saved activations fit `--budget-mib` per rank, at cp = 1, 2, 4
   (activations grow linearly in the local length: fit at two lengths, then verified).
3. Load balance (causal): query-key pairs attended and computed per rank, max / min, with and
   without load balancing at cp = 2, 4; and the measured time of each rank's block computations.
4. Bytes each rank sends per step (one forward + backward), counted at the collectives, vs
   smp.context_parallel.cost.bytes_per_step, for ring and allgather.
5. Step time (forward + backward + SGD, smp.transform with FSDP) at world 2: cp = 2 vs cp = 1
   (FSDP 2) at equal tokens per step (2 sequences of --seq tokens), ring and allgather.
6. Ulysses vs ring at cp = 2 and 4 (4 key/value heads, so that cp 4 splits them): bytes each
   rank sends per step, counted at the collectives (Ulysses: its forward all-to-alls, each
   mirrored in backward by autograd, and its all-gather) vs cost.bytes_per_step, and step time
   (world = cp, one sequence of --seq tokens), in the same run.

    python bench/bench_context_parallel.py --only ulysses   # section 6 alone

Writes bench/results/context_parallel.json (section 6 alone: context_parallel_ulysses.json).
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
from smp.context_parallel import allgather, apply_context_parallel, cost, ring, shard_batch, ulysses
from smp.testing.models import tiny_llama_config
from smp.testing.rank_pool import RankPool

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=1 << 16)


def build():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**MODEL))


def _saved_bytes(model, batch) -> dict[str, int]:
    """Bytes of the storages autograd saves in one forward (parameters left out, each once)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    counts = {"blocks": 0, "total": 0}
    inside = [False]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen.add(ptr)
            counts["total"] += storage.nbytes()
            counts["blocks"] += storage.nbytes() if inside[0] else 0
        return t

    def enter(*_):
        inside[0] = True

    def leave(*_):
        inside[0] = False

    handles = [h for layer in model.model.layers
               for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    for h in handles:
        h.remove()
    del loss
    return counts


def activations(cp: int, seqs: list[int]) -> dict:
    """Saved bytes per rank at each sequence length (run on every rank of a world of cp)."""
    with smp.session({"context_parallel_degree": cp}):
        model = build()
        if cp > 1:
            apply_context_parallel(model, smp.state.mesh["cp"], "ring", True)
        out = {}
        for seq in seqs:
            ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
            out[seq] = _saved_bytes(model, shard_batch(ids))
        return out


def load_balance(cp: int, seq: int, balanced: bool) -> dict:
    """Seconds this rank spends in block computations over one attention forward + backward."""
    with smp.session({"context_parallel_degree": cp, "context_parallel": {"load_balance": balanced}}):
        model = build()
        apply_context_parallel(model, smp.state.mesh["cp"], "ring", balanced)
        spent = [0.0]
        real_fwd, real_bwd = ring.block_forward, ring.block_backward

        def timed(fn):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                spent[0] += time.perf_counter() - t0
                return result
            return run

        ring.block_forward, ring.block_backward = timed(real_fwd), timed(real_bwd)
        try:
            ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
            model(**shard_batch(ids)).loss.backward()
        finally:
            ring.block_forward, ring.block_backward = real_fwd, real_bwd
        return {"rank": smp.state.cp_rank, "block_seconds": spent[0]}


def bytes_moved(cp: int, seq: int, algorithm: str) -> dict:
    """Bytes this rank sends in one forward + backward, counted at the collectives."""
    with smp.session({"context_parallel_degree": cp}):
        model = build()
        apply_context_parallel(model, smp.state.mesh["cp"], algorithm, True)
        sent = [0]
        real_exchange, real_gather, real_rs = ring._exchange, allgather._gather, dist.reduce_scatter_tensor

        def exchange(buffer, *args):
            sent[0] += buffer.numel() * buffer.element_size()
            return real_exchange(buffer, *args)

        def gather(buffer, group, size):
            sent[0] += (size - 1) * buffer.numel() * buffer.element_size()
            return real_gather(buffer, group, size)

        def reduce_scatter(out, inp, group=None, **kw):
            sent[0] += (inp.numel() - out.numel()) * inp.element_size()
            return real_rs(out, inp, group=group, **kw)

        ring._exchange, allgather._gather, allgather.dist.reduce_scatter_tensor = exchange, gather, reduce_scatter
        try:
            ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(2))
            model(**shard_batch(ids)).loss.backward()
        finally:
            ring._exchange, allgather._gather, allgather.dist.reduce_scatter_tensor = real_exchange, real_gather, real_rs
        kv_dim = MODEL["num_key_value_heads"] * MODEL["hidden_size"] // MODEL["num_attention_heads"]
        formula = cost.bytes_per_step(algorithm, cp, 1, seq, kv_dim, MODEL["num_hidden_layers"])
        return {"measured": sent[0], "formula": formula}


ULYSSES_MODEL = {**MODEL, "num_key_value_heads": 4}


def ulysses_vs_ring(cp: int, seq: int, algorithm: str, steps: int) -> dict:
    """Bytes this rank sends in one forward + backward (counted at the collectives) vs the
    formula, and the median step time, for `algorithm` at context_parallel_degree = world = cp."""
    from transformers import LlamaForCausalLM

    config = {"context_parallel_degree": cp, "context_parallel": {"algorithm": algorithm}}
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(LlamaForCausalLM(tiny_llama_config(**ULYSSES_MODEL)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(2))
        batch = shard_batch(ids)
        sent = [0]
        saved = ring._exchange, allgather._gather, allgather.dist.reduce_scatter_tensor, ulysses.all_to_all_autograd
        real_gather_tokens = ulysses.dist.all_gather_into_tensor

        def exchange(buffer, *args):
            sent[0] += buffer.numel() * buffer.element_size()
            return saved[0](buffer, *args)

        def gather(buffer, group, size):
            sent[0] += (size - 1) * buffer.numel() * buffer.element_size()
            return saved[1](buffer, group, size)

        def reduce_scatter(out, inp, group=None, **kw):
            sent[0] += (inp.numel() - out.numel()) * inp.element_size()
            return saved[2](out, inp, group=group, **kw)

        def all_to_all(t, out_splits, in_splits, group):  # forward; autograd sends as much back
            sent[0] += 2 * t.numel() * t.element_size() * (len(in_splits) - 1) // len(in_splits)
            return saved[3](t, out_splits, in_splits, group)

        def gather_tokens(out, inp, group=None, **kw):
            sent[0] += (cp - 1) * inp.numel() * inp.element_size()
            return real_gather_tokens(out, inp, group=group, **kw)

        ring._exchange, allgather._gather, allgather.dist.reduce_scatter_tensor, ulysses.all_to_all_autograd = (
            exchange, gather, reduce_scatter, all_to_all)
        ulysses.dist.all_gather_into_tensor = gather_tokens
        try:
            model(**batch).loss.backward()
        finally:
            ring._exchange, allgather._gather, allgather.dist.reduce_scatter_tensor, ulysses.all_to_all_autograd = saved
            ulysses.dist.all_gather_into_tensor = real_gather_tokens
        opt.zero_grad()
        head_dim = MODEL["hidden_size"] // MODEL["num_attention_heads"]
        formula = cost.bytes_per_step(algorithm, cp, 1, seq, ULYSSES_MODEL["num_key_value_heads"] * head_dim,
                                      MODEL["num_hidden_layers"], q_dim=MODEL["hidden_size"])
        times = []
        for _ in range(steps + 1):  # the first step warms up
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return {"measured": sent[0], "formula": formula, "median_s": statistics.median(times[1:])}


def ulysses_section(pools: dict, seq: int, steps: int) -> dict:
    out = {}
    for cp in (2, 4):
        for algorithm in ("ring", "ulysses"):
            per_rank = pools[cp].run(ulysses_vs_ring, cp=cp, seq=seq, algorithm=algorithm, steps=steps, timeout=1200)
            out[f"cp{cp}_{algorithm}"] = {"measured_per_rank": [r["measured"] for r in per_rank],
                                          "formula": per_rank[0]["formula"],
                                          "median_step_s": max(r["median_s"] for r in per_rank)}
    print(json.dumps({"ulysses_vs_ring": out}), flush=True)
    return out


def step_time(config: dict, seq: int, steps: int) -> dict:
    """Median step seconds at 2 sequences of `seq` tokens per step over the world."""
    with smp.session(config):
        model = smp.transform(build())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(3)
        rows = torch.randint(0, MODEL["vocab_size"], (2, seq), generator=g)
        per = 2 // smp.state.dp_size
        mine = rows[smp.state.dp_rank * per:(smp.state.dp_rank + 1) * per]
        times = []
        for _ in range(steps + 1):  # the first step warms up
            t0 = time.perf_counter()
            model(**shard_batch(mine)).loss.backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(times[1:]), "tokens_per_step": 2 * seq}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--budget-mib", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=["ulysses"], default=None, help="run section 6 alone")
    args = p.parse_args()
    command = (f"python bench/bench_context_parallel.py --seq {args.seq} --budget-mib {args.budget_mib} "
               f"--steps {args.steps}")
    if args.only == "ulysses":
        pools = {w: RankPool(w) for w in (2, 4)}
        try:
            result = {"model": ULYSSES_MODEL, "seq": args.seq, "command": command + " --only ulysses",
                      "ulysses_vs_ring": ulysses_section(pools, args.seq, args.steps)}
        finally:
            for pool in pools.values():
                pool.close()
        out = Path(args.out or "bench/results/context_parallel_ulysses.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return
    result: dict = {"model": MODEL, "seq": args.seq, "command": command}
    pools = {w: RankPool(w) for w in (1, 2, 4)}
    try:
        # 1 + 2. Activation bytes per rank, and the longest sequence in the budget.
        budget = args.budget_mib * 2**20
        acts, longest = {}, {}
        for cp in (1, 2, 4):
            fit = pools[cp].run(activations, cp=cp, seqs=[args.seq, 2 * args.seq], timeout=1200)[0]
            acts[cp] = fit[args.seq]
            slope = (fit[2 * args.seq]["total"] - fit[args.seq]["total"]) / args.seq
            base = fit[args.seq]["total"] - slope * args.seq
            step = 2 * cp
            guess = int((budget - base) / slope) // step * step
            checked = pools[cp].run(activations, cp=cp, seqs=[guess], timeout=1200)[0][guess]["total"]
            while checked > budget:
                guess -= step
                checked = pools[cp].run(activations, cp=cp, seqs=[guess], timeout=1200)[0][guess]["total"]
            longest[cp] = {"seq": guess, "saved_bytes": checked}
        result["activations"] = {
            cp: {**acts[cp], "blocks_ratio_to_cp1": acts[cp]["blocks"] / acts[1]["blocks"],
                 "total_ratio_to_cp1": acts[cp]["total"] / acts[1]["total"], "goal": 1 / cp}
            for cp in acts
        }
        result["longest_seq_in_budget"] = {"budget_mib": args.budget_mib, **{
            cp: {**v, "vs_cp1": v["seq"] / longest[1]["seq"]} for cp, v in longest.items()}}
        print(json.dumps({"activations": result["activations"], "longest": result["longest_seq_in_budget"]}), flush=True)

        # 3. Load balance: pairs by formula (what the kernel computes), time measured.
        balance = {}
        for cp in (2, 4):
            for balanced in (True, False):
                pairs = [cost.attention_pairs(args.seq, cp, r, balanced) for r in range(cp)]
                computed = [cost.attention_pairs(args.seq, cp, r, balanced, computed=True) for r in range(cp)]
                timed = pools[cp].run(load_balance, cp=cp, seq=args.seq, balanced=balanced, timeout=1200)
                secs = [t["block_seconds"] for t in sorted(timed, key=lambda t: t["rank"])]
                balance[f"cp{cp}_{'balanced' if balanced else 'unbalanced'}"] = {
                    "attended_pairs": pairs, "attended_max_min": max(pairs) / min(pairs),
                    "computed_pairs": computed, "computed_max_min": max(computed) / min(computed),
                    "block_seconds": secs, "time_max_min": max(secs) / min(secs),
                }
        result["load_balance"] = balance
        print(json.dumps({"load_balance": balance}), flush=True)

        # 4. Bytes per step vs formula.
        moved = {}
        for cp in (2, 4):
            for algorithm in ("ring", "allgather"):
                per_rank = pools[cp].run(bytes_moved, cp=cp, seq=args.seq, algorithm=algorithm, timeout=1200)
                moved[f"cp{cp}_{algorithm}"] = {"measured_per_rank": [r["measured"] for r in per_rank],
                                                "formula": per_rank[0]["formula"]}
        result["bytes_per_step"] = moved
        print(json.dumps({"bytes_per_step": moved}), flush=True)

        # 5. Step time at equal tokens per step, world 2.
        times = {}
        for name, config in [("cp1_fsdp2", {}), ("cp2_ring", {"context_parallel_degree": 2}),
                             ("cp2_allgather", {"context_parallel_degree": 2, "context_parallel": {"algorithm": "allgather"}})]:
            times[name] = pools[2].run(step_time, config=config, seq=args.seq, steps=args.steps, timeout=1200)[0]
        for name in ("cp2_ring", "cp2_allgather"):
            times[name]["vs_cp1"] = times[name]["median_s"] / times["cp1_fsdp2"]["median_s"]
        result["step_time_w2"] = times
        print(json.dumps({"step_time_w2": times}), flush=True)

        # 6. Ulysses vs ring.
        result["ulysses_vs_ring"] = ulysses_section(pools, args.seq, args.steps)
    finally:
        for pool in pools.values():
            pool.close()
    out = Path(args.out or "bench/results/context_parallel.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
