"""Pipeline parallelism: bubble, point-to-point bytes, activation memory, composition and a
hand-written torch.distributed.pipelining baseline, side by side in one run (CPU gloo ranks).

    python bench/bench_pipeline.py [--rounds 5] [--steps 4] [--unit-ms 3]

(a) Bubble fraction per schedule at p = 2, 4 and m = 4, 8, 16, measured from per-rank compute
    timestamps (time inside each PipelineStage's forward_one_chunk / backward_one_chunk /
    backward_weight_one_chunk vs the step's wall time: bubble = 1 - busy / step), vs the plan's
    figure (smp.planning.pipeline: torch's own order run with T_F = T_I = T_W) and the closed
    form where the papers give one. The compute is a stand-in: each of 8 blocks sleeps --unit-ms
    in forward, as long in its input gradient and as long in its weight gradient (a sleep frees
    the core, so 4 ranks on 2 cores overlap like 4 devices, and the split-backward schedules see
    a real weight-gradient step).
(b) Point-to-point bytes per step, counted at torch's P2POp (every isend a PipelineStage
    issues), vs 2 x m x rows x seq x hidden x 4 B per boundary between ranks; in the runs of (a)
    (second step: the first also sends shape metadata) and in (c) against `smp plan`.
(c) Peak saved-activation bytes per rank, GPipe vs 1F1B, a small Llama at pp 2 and 4, m = 8:
    live bytes of the tensors autograd saves (a saved-tensor hook: counted at pack, released
    when autograd frees them, each storage once, parameters left out), vs the plan.
(d) Step time, PP 2 x FSDP 2 vs FSDP 4 on the same model and global batch at world 4 (AdamW).
(e) smp (`smp.transform` + `smp.pipeline.step`) vs a hand-written baseline written the way
    torchtitan writes it (a stage module made from the model's own layers, PipelineStage,
    Schedule1F1B, a mean cross-entropy loss_fn), same model, same batch, pp 2, m = 4: rounds
    alternate which runs first; median and spread of the per-step times.

Writes bench/results/pipeline.json (with the load average before and after).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import smp
import smp.pipeline
from smp.testing.models import random_batch, tiny_llama
from smp.testing.rank_pool import RankPool

RESULT = Path(__file__).parent / "results" / "pipeline.json"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
             "dualpipev")


# ----------------------------------------------------------------------------------------------
# Counters (rank side)


class P2PCounter:
    """Bytes handed to dist.isend through dist.P2POp (how PipelineStage sends everything)."""

    def __init__(self):
        self.sent = 0

    def __enter__(self):
        self.original = dist.P2POp
        counter = self

        class Counted(self.original):
            def __init__(self, op, tensor, *args, **kwargs):
                super().__init__(op, tensor, *args, **kwargs)
                if op is dist.isend:
                    counter.sent += tensor.numel() * tensor.element_size()

        dist.P2POp = Counted
        return self

    def __exit__(self, *exc):
        dist.P2POp = self.original


class ComputeClock:
    """Seconds spent inside PipelineStage's compute methods (forward, backward, weight gradient)."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self):
        self.busy = 0.0
        self.depth = 0

    def __enter__(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.cls, self.saved = _PipelineStageBase, {}
        for name in self.METHODS:
            original = getattr(_PipelineStageBase, name)
            self.saved[name] = original
            setattr(_PipelineStageBase, name, self._timed(original))
        return self

    def _timed(self, fn):
        clock = self

        def wrapper(*args, **kwargs):
            clock.depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.depth -= 1
                if clock.depth == 0:  # one call may call another (V schedules): count it once
                    clock.busy += time.perf_counter() - t

        return wrapper

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)


class LiveSavedBytes:
    """Peak live bytes of autograd's saved tensors (each storage once, parameters left out)."""

    def __init__(self, model):
        from smp.testing.distributed import local_tensor

        self.params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.refs, self.sizes = {}, {}
        self.current = self.peak = 0

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        if ptr not in self.refs:
            self.refs[ptr], self.sizes[ptr] = 0, t.untyped_storage().nbytes()
            self.current += self.sizes[ptr]
            self.peak = max(self.peak, self.current)
        self.refs[ptr] += 1
        return _Held(self, ptr, t)

    def release(self, ptr):
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.current -= self.sizes.pop(ptr)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor if isinstance(h, _Held) else h)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class _Held:
    def __init__(self, owner, ptr, tensor):
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self):
        self.owner.release(self.ptr)


# ----------------------------------------------------------------------------------------------
# (a) + (b): the sleeping stand-in model


class _SleepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)  # the input gradient (I)
        return grad, None


class _SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, seconds):
        ctx.seconds = seconds
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)  # the weight gradient (W): only on the path to the parameter
        return grad, None


class SleepBlock(nn.Module):
    def __init__(self, hidden: int, seconds: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(hidden))
        self.seconds = seconds

    def forward(self, x):
        return _SleepInput.apply(x, self.seconds) * _SleepWeight.apply(self.w, self.seconds)


class SleepModel(nn.Module):
    """Embedding, 8 sleeping blocks, head: a plain model smp splits like a causal LM."""

    def __init__(self, vocab: int, hidden: int, layers: int, seconds: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(SleepBlock(hidden, seconds) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def bubble_runs(pp: int, unit_ms: float, steps: int, hidden: int = 16, seq: int = 8, layers: int = 8) -> list[dict]:
    """Every schedule at this pp and m = 4, 8, 16 (rows = m: one row per micro-batch)."""
    out = []
    for schedule in SCHEDULES:
        for m in (4, 8, 16):
            stages = pp * (1 if schedule in ("gpipe", "1f1b") else 2)
            # An explicit even split: the automatic one balances FLOPs, and the sleeping blocks have almost none.
            split = [layers // stages * k for k in range(1, stages)]
            config = {"pipeline_parallel_degree": pp,
                      "pipeline": {"schedule": schedule, "microbatches": m, "split": split}}
            row = {"schedule": schedule, "pp": pp, "m": m}
            try:
                with smp.session(config):
                    torch.manual_seed(0)
                    model = smp.transform(SleepModel(64, hidden, layers, unit_ms / 1000))
                    ids = random_batch(m, seq, 64, seed=0)
                    smp.pipeline.step(model, ids)  # shape inference, first-step set-up
                    walls, bubbles, sent = [], [], []
                    for _ in range(steps):
                        dist.barrier()
                        with P2PCounter() as p2p, ComputeClock() as clock:
                            t = time.perf_counter()
                            smp.pipeline.step(model, ids)
                            wall = time.perf_counter() - t
                        walls.append(wall)
                        bubbles.append(1 - clock.busy / wall)
                        sent.append(p2p.sent)
                    cross = stages - 1 - (1 if schedule in ("zbv_zero_bubble", "dualpipev") else 0)
                    row.update(step_s=statistics.median(walls), bubble=statistics.median(bubbles),
                               sent=sent[-1], sent_every_step_equal=len(set(sent)) == 1,
                               # one row per micro-batch: 2 directions x m x (1 x seq x hidden x 4 B) per boundary
                               formula_bytes_total=cross * 2 * m * seq * hidden * 4, stages=stages)
            except Exception as e:  # a combination torch or smp refuses: recorded
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out.append(row)
    return out


# ----------------------------------------------------------------------------------------------
# (c) activations, (d) composition, (e) hand-written baseline: a small Llama

LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
MEDIUM = dict(LLAMA, hidden_size=256, intermediate_size=512)  # (e) again, 4x the matmul work per token


def activation_runs(pp: int, m: int = 8, batch: int = 8, seq: int = 64) -> list[dict]:
    out = []
    for schedule in ("gpipe", "1f1b"):
        config = {"pipeline_parallel_degree": pp, "pipeline": {"schedule": schedule, "microbatches": m}}
        with smp.session(config):
            torch.manual_seed(0)
            model = smp.transform(tiny_llama(**LLAMA))
            ids = random_batch(batch, seq, 256, seed=0)
            smp.pipeline.step(model, ids)
            model.zero_grad()
            with LiveSavedBytes(model) as saved, P2PCounter() as p2p:
                smp.pipeline.step(model, ids)
            out.append({"schedule": schedule, "pp": pp, "rank": dist.get_rank(), "saved_peak": saved.peak,
                        "sent": p2p.sent})
    return out


def _timed_steps(step, steps: int, cpu: list | None = None) -> list[float]:
    """Wall seconds of each step (after a barrier); `cpu` collects this process's CPU seconds
    (all its threads) per step, which the other processes on the machine disturb less."""
    times = []
    for _ in range(steps):
        dist.barrier()
        c, t = time.process_time(), time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.process_time() - c)
    return times


def composition_runs(steps: int, batch: int = 8, seq: int = 64) -> dict:
    """PP 2 x FSDP 2 vs FSDP 4, same model and global batch, AdamW; rank 0's step times."""
    out = {}
    ids = random_batch(batch, seq, 256, seed=0)
    for name, config in (("pp2_fsdp2", {"pipeline_parallel_degree": 2, "pipeline": {"schedule": "1f1b", "microbatches": 2}}),
                         ("fsdp4", {})):
        with smp.session(config):
            torch.manual_seed(0)
            model = smp.transform(tiny_llama(**LLAMA))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            world, pp = dist.get_world_size(), config.get("pipeline_parallel_degree", 1)
            dp, dp_rank = world // pp, dist.get_rank() % (world // pp)
            rows = ids[dp_rank * batch // dp:(dp_rank + 1) * batch // dp]

            def step():
                if pp > 1:
                    smp.pipeline.step(model, rows)
                else:
                    model(input_ids=rows, labels=rows).loss.backward()
                opt.step()
                opt.zero_grad()

            step()  # warm-up
            out[name] = _timed_steps(step, steps)
    return out


class HandStage(nn.Module):
    """A pipeline stage written by hand, torchtitan's way: the model's own modules this stage
    owns, the rest left out, and a forward that runs them (rotary embeddings on every stage)."""

    def __init__(self, model, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.norm = model.model.norm if last else None
        self.output = model.lm_head if last else None
        self.rotary_emb = model.model.rotary_emb

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
            h = h[0] if isinstance(h, tuple) else h
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def _mean_ce(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def peer_runs(rounds: int, steps: int, batch: int = 8, seq: int = 64, m: int = 4, model: dict = LLAMA) -> dict:
    """smp vs hand-written, pp 2, Schedule1F1B, SGD; rank 0's per-step times by round, the
    losses of the first step of each (equal: same init, same batch)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    config = {"pipeline_parallel_degree": 2, "pipeline": {"schedule": "1f1b", "microbatches": m}}
    ids = random_batch(batch, seq, 256, seed=0)
    times = {"smp": [], "hand": []}
    cpu = {"smp": [], "hand": []}
    losses = {}
    with smp.session(config):
        torch.manual_seed(0)
        reference = tiny_llama(**model)
        rank = dist.get_rank()
        smp_model = smp.transform(copy.deepcopy(reference))
        smp_opt = torch.optim.SGD(smp_model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
        half = model["num_hidden_layers"] // 2
        hand = HandStage(copy.deepcopy(reference), range(half) if rank == 0 else range(half, 2 * half),
                         rank == 0, rank == 1)
        hand_opt = torch.optim.SGD(hand.parameters(), lr=0.0)
        stage = PipelineStage(hand, rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=_mean_ce)

        def smp_step():
            loss = smp.pipeline.step(smp_model, ids)
            smp_opt.step()
            smp_opt.zero_grad()
            return float(loss)

        def hand_step():
            out = []
            if rank == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids, losses=out)
            hand_opt.step()
            hand_opt.zero_grad()
            return float(torch.stack(out).mean()) if out else None

        losses["smp"], losses["hand"] = smp_step(), hand_step()  # warm-up (shape inference) and the check
        for r in range(rounds):
            order = ("smp", "hand") if r % 2 == 0 else ("hand", "smp")
            for peer in order:
                times[peer].append(_timed_steps(smp_step if peer == "smp" else hand_step, steps, cpu[peer]))
    return {"times": times, "cpu": cpu, "losses": losses}


def stage_call_overhead(model: dict = LLAMA, seq: int = 64, rows: int = 2, calls: int = 200) -> dict:
    """CPU ms per forward call (no grad, one process) of smp's stage modules (the model's own
    forward: masks, position ids, output classes) vs the hand-written stages (the layers called
    directly), on the same micro-batch; the two give equal outputs."""
    from smp.pipeline import build_stage_module, find_parts, plan_split

    torch.manual_seed(0)
    reference = tiny_llama(**model)
    parts, split = find_parts(reference), plan_split(reference, 2)
    ids = torch.randint(0, 256, (rows, seq))
    out = {}
    for info in split:
        stages = {"smp": build_stage_module(reference, parts, info),
                  "hand": HandStage(reference, info.layers, info.first, info.last)}
        x = ids if info.first else torch.randn(rows, seq, model["hidden_size"])
        ms = {}
        with torch.no_grad():
            assert torch.equal(stages["smp"](x), stages["hand"](x))
            for name in ("smp", "hand", "smp", "hand"):  # the second pass counts
                c = time.process_time()
                for _ in range(calls):
                    stages[name](x)
                ms[name] = round((time.process_time() - c) / calls * 1e3, 3)
        out[f"stage{info.index}"] = {**ms, "overhead_ms": round(ms["smp"] - ms["hand"], 3)}
    return out


# ----------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--unit-ms", type=float, default=3.0)
    p.add_argument("--only", default="abcde", help="sections to run, e.g. 'ae'")
    args = p.parse_args()
    from smp.planning import plan
    from smp.planning.pipeline import bubble_formula
    from smp.testing.models import tiny_llama_config

    previous = json.loads(RESULT.read_text()) if RESULT.exists() and args.only != "abcde" else {}
    result: dict = {
        **previous,
        "command": f"python bench/bench_pipeline.py --rounds {args.rounds} --steps {args.steps} --unit-ms {args.unit_ms}",
        "machine": f"{os.cpu_count()} cores", "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
    }
    pools = {w: RankPool(w) for w in (2, 4)}
    try:
        if "a" in args.only or "b" in args.only:
            rows = []
            for pp in (2, 4):
                per_rank = pools[pp].run(bubble_runs, pp=pp, unit_ms=args.unit_ms, steps=args.steps, timeout=1200)
                for i, row in enumerate(per_rank[0]):
                    if "error" not in row:
                        cfg = {"pipeline_parallel_degree": pp,
                               "pipeline": {"schedule": row["schedule"], "microbatches": row["m"]}}
                        planned = plan(cfg, tiny_llama_config(num_hidden_layers=8), pp, seq_len=8,  # orders only
                                       micro_batch=row["m"]).pipeline
                        formula, _ = bubble_formula(row["schedule"], pp, row["m"], row["stages"] // pp)
                        measured = [r[i]["bubble"] for r in per_rank]
                        sent = [r[i]["sent"] for r in per_rank]
                        row = {**row, "bubble_per_rank": [round(b, 4) for b in measured],
                               "bubble": round(statistics.mean(measured), 4),
                               "bubble_plan": round(statistics.mean(planned["bubble_per_rank"]), 4),
                               "bubble_formula": None if formula is None else round(formula, 4),
                               "sent_per_rank": sent, "sent_total": sum(sent),
                               "p2p_exact": sum(sent) == row["formula_bytes_total"]
                               and all(r[i]["sent_every_step_equal"] for r in per_rank)}
                        row.pop("sent")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            result["bubble"] = {"unit_ms": args.unit_ms, "layers": 8, "rows": rows}

        if "c" in args.only:
            acts = []
            for pp in (2, 4):
                per_rank = pools[pp].run(activation_runs, pp=pp, timeout=1200)
                for rank_rows in per_rank:
                    for row in rank_rows:
                        cfg = {"pipeline_parallel_degree": pp, "pipeline": {"schedule": row["schedule"], "microbatches": 8}}
                        planned = plan(cfg, tiny_llama_config(**LLAMA), pp, rank=row["rank"], seq_len=64, micro_batch=8)
                        per_mb = planned.pipeline["stages"][0]["activation_bytes_per_microbatch"]
                        row.update(plan_bytes=planned.activation_bytes, plan_held=planned.pipeline["stages"][0]["microbatches_held"],
                                   measured_over_plan=round(row["saved_peak"] / planned.activation_bytes, 4),
                                   measured_microbatches=round(row["saved_peak"] / per_mb, 2),
                                   plan_p2p_send=planned.pipeline["p2p_send_bytes"],
                                   p2p_exact=row["sent"] == planned.pipeline["p2p_send_bytes"])
                        acts.append(row)
                        print(json.dumps(row), flush=True)
            result["activations"] = {"model": LLAMA, "seq": 64, "batch": 8, "microbatches": 8, "rows": acts}

        if "d" in args.only:
            per_rank = pools[4].run(composition_runs, steps=args.steps * 2, timeout=1200)
            comp = {name: {"median_s": round(statistics.median(t), 4), "min_s": round(min(t), 4),
                           "max_s": round(max(t), 4)} for name, t in per_rank[0].items()}
            comp["ratio_pp2_fsdp2_over_fsdp4"] = round(comp["pp2_fsdp2"]["median_s"] / comp["fsdp4"]["median_s"], 3)
            result["composition_w4"] = {"model": LLAMA, "global_batch": 8, "seq": 64, **comp}
            print(json.dumps(result["composition_w4"]), flush=True)

        if "e" in args.only:
            result["vs_hand_written"] = {"stage_forward_cpu_ms": stage_call_overhead()}
            print(json.dumps(result["vs_hand_written"]), flush=True)
            for size, model, seq in (("small", LLAMA, 64), ("medium", MEDIUM, 128)):
                out = pools[2].run(peer_runs, rounds=args.rounds, steps=args.steps, seq=seq, model=model, timeout=1800)
                times, losses = out[0]["times"], out[1]["losses"]  # losses live on the last stage (rank 1)
                cpu = {peer: sum(statistics.median(o["cpu"][peer]) for o in out) for peer in ("smp", "hand")}
                med = {peer: [statistics.median(r) for r in rounds] for peer, rounds in times.items()}
                ratios = [s / h for s, h in zip(med["smp"], med["hand"])]
                result["vs_hand_written"][size] = {
                    "model": model, "batch": 8, "seq": seq, "microbatches": 4, "schedule": "1f1b",
                    "smp_median_s": round(statistics.median([t for r in times["smp"] for t in r]), 4),
                    "hand_median_s": round(statistics.median([t for r in times["hand"] for t in r]), 4),
                    "ratio_per_round": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3),
                    "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
                    "cpu_s_per_step_both_ranks": {k: round(v, 4) for k, v in cpu.items()},
                    "cpu_ratio": round(cpu["smp"] / cpu["hand"], 3),
                    "first_step_loss": losses, "goal": "<= 1.02",
                }
                print(json.dumps({size: result["vs_hand_written"][size]}), flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
