"""Host cost of a step: smp vs its fair baselines, on the CPU proxy of the GPU check's host-bound step.

    python bench/bench_host.py [--rounds 7] [--layers 16] [--world 1 2] [--checkpointing] [--backends aot_eager]

The GPU check's config on a tiny-width 16-layer Llama (hidden 64, so the step is all host work):
bf16 parameters + fp32 reduce, bf16 autocast, AdamW. Each variant stays resident and steps in
interleaved rounds (A, B, A, B, ...); per step it reports the median thread-CPU time of forward,
backward and optimizer (`time.thread_time`: robust to other jobs on shared cores), and, for one
step, Python calls (`sys.setprofile` 'call' events) and aten ops (a TorchDispatchMode counter).

- world 1: smp (its layout: no FSDP units over one rank) / plain PyTorch (fp32 parameters under
  autocast, no smp), goal <= 1.05; smp's previous layout (one FSDP unit per block) beside them.
- world 2 (two gloo processes, rank 0's figures): smp (merged units) / hand-written FSDP2 the way
  torchtitan writes it (`fully_shard` per decoder layer, then the root, same MixedPrecisionPolicy,
  reshard_after_forward=True), goal <= 0.95.
- `--checkpointing`: activation checkpointing none / full / selective through smp at world 1, eager
  and under `torch.compile` per block (`--backends`: aot_eager, inductor).
- `--offloading`: activation offloading with checkpointing none and full (step time vs the same
  checkpointing without it; bytes moved vs the bound).
Writes bench/results/host.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "host.json"
BF16 = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
BATCH, SEQ, VOCAB = 2, 64, 256


def build_llama(layers: int) -> torch.nn.Module:
    from smp.testing.models import tiny_llama

    torch.manual_seed(0)
    return tiny_llama(num_hidden_layers=layers, max_position_embeddings=SEQ, use_cache=False)


class PythonCalls:
    """Python function calls while active ('call' events of sys.setprofile)."""

    def __enter__(self):
        self.calls = 0

        def profile(frame, event, arg):
            if event == "call":
                self.calls += 1
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


class Runner:
    """One resident model + AdamW; `step()` returns thread-CPU seconds of forward, backward, optimizer."""

    def __init__(self, name: str, model: torch.nn.Module, ids: torch.Tensor) -> None:
        self.name, self.model, self.ids = name, model, ids
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "step": []}

    def step(self, record: bool = True) -> None:
        t0 = time.thread_time()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        self.opt.step()
        self.opt.zero_grad()
        t3 = time.thread_time()
        if record:
            for key, value in zip(self.times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                self.times[key].append(value)

    def counts(self) -> dict[str, int]:
        from smp.activations.accounting import OpCounter

        with PythonCalls() as calls:
            self.step(record=False)
        with OpCounter() as ops:
            self.step(record=False)
        return {"python_calls": calls.calls, "aten_ops": sum(ops.counts.values())}

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) * 1e3 for k, v in self.times.items()}


def interleave(runners: list[Runner], rounds: int, steps: int = 3, warmup: int = 2) -> None:
    for r in runners:
        for _ in range(warmup):
            r.step(record=False)
    for _ in range(rounds):
        for r in runners:
            for _ in range(steps):
                r.step()


def summary(runners: list[Runner], baseline: str) -> dict:
    out = {r.name: {"ms": r.medians(), **r.counts()} for r in runners}
    base = out[baseline]["ms"]
    for name, figures in out.items():
        figures["ratio_to_" + baseline] = {k: round(figures["ms"][k] / base[k], 3) for k in base}
    return out


@contextlib.contextmanager
def per_block_units():
    from smp.sharding import fsdp

    with mock.patch.object(fsdp, "unit_layout", lambda *a, **k: "blocks"):
        yield


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def world1(layers: int, rounds: int) -> dict:
    import smp

    _env(0, 1, 29731)
    base = build_llama(layers)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with smp.session(BF16):
        with per_block_units():
            per_block = smp.transform(copy.deepcopy(base))
        model = smp.transform(copy.deepcopy(base))
        runners = [Runner("plain", copy.deepcopy(base), ids), Runner("smp", model, ids),
                   Runner("smp_per_block_units", per_block, ids)]
        interleave(runners, rounds)
        return summary(runners, "plain")


def _world2_rank(rank: int, layers: int, rounds: int, out: str) -> None:
    import smp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _env(rank, 2, 29733)
    base = build_llama(layers)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    with smp.session(BF16):
        model = smp.transform(copy.deepcopy(base))
        hand = copy.deepcopy(base)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = smp.state.mesh["dp"] if "dp" in smp.state.mesh.mesh_dim_names else None
        for layer in hand.model.layers:  # torchtitan's apply_fsdp: each layer, then the root
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(hand, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        runners = [Runner("fsdp2_per_block", hand, ids), Runner("smp", model, ids)]
        interleave(runners, rounds)
        result = summary(runners, "fsdp2_per_block")
        from smp.sharding.fsdp import describe_layout

        result["smp"]["layout"] = describe_layout(model)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def world2(layers: int, rounds: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "w2.json")
        mp.start_processes(_world2_rank, args=(layers, rounds, out), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


def checkpointing(layers: int, rounds: int, backends: list[str]) -> dict:
    """none / full / selective through smp at world 1, eager and compiled per block."""
    import smp

    _env(0, 1, 29735)
    base = build_llama(layers)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ["eager", *backends]:
        runners = []
        for mode in ("none", "full", "selective"):
            cfg = {**BF16, "activation_checkpointing": mode}
            if backend != "eager":
                cfg["compile"] = {"enabled": True, "backend": backend}
            with smp.session(cfg):
                runners.append(Runner(mode, smp.transform(copy.deepcopy(base)), ids))
        interleave(runners, rounds)
        results[backend] = summary(runners, "none")
        print(f"checkpointing ({backend}):", json.dumps({k: v["ratio_to_none"]["step"] for k, v in results[backend].items()}),
              flush=True)
        if backend != "eager":
            torch._dynamo.reset()
    return results


def offloading(layers: int, rounds: int, horizon: int = 2) -> dict:
    """Offloading with checkpointing none and full through smp at world 1: step time against the
    same checkpointing without it, and the bytes it moved against the bound (all that autograd
    saved in the blocks, less the `horizon` largest blocks' share). On CPU the "host" copies are
    plain tensors: the device peak it lowers is the GPU check's to measure (docs/gpu-check.md)."""
    import smp
    from smp.activations.offloading import offload_stats

    _env(0, 1, 29737)
    base = build_llama(layers)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    # Every saved tensor may move (min_bytes 0): the tiny proxy's tensors are all small.
    offload = {"activation_offloading": True, "activation_loading_horizon": horizon, "activation_offload_min_bytes": 0}
    settings = {"none": {}, "offload": offload, "full": {"activation_checkpointing": "full"},
                "offload+full": {**offload, "activation_checkpointing": "full"}}
    runners = []
    for name, extra in settings.items():
        with smp.session({**BF16, **extra}):
            runners.append(Runner(name, smp.transform(copy.deepcopy(base)), ids))
    interleave(runners, rounds)
    out = summary(runners, "none")
    for r in runners:
        stats = offload_stats(r.model)
        if stats is not None:
            moved = sorted(stats.offloaded_bytes, reverse=True)
            out[r.name]["saved_bytes"] = sum(stats.saved_bytes)
            out[r.name]["moved_bytes"] = sum(moved)
            out[r.name]["bound_bytes"] = sum(stats.saved_bytes) - sum(sorted(stats.saved_bytes, reverse=True)[:horizon])
            out[r.name]["max_layers_resident"] = stats.max_layers_resident
    out["offload"]["step_vs_same_checkpointing"] = round(out["offload"]["ms"]["step"] / out["none"]["ms"]["step"], 3)
    out["offload+full"]["step_vs_same_checkpointing"] = round(
        out["offload+full"]["ms"]["step"] / out["full"]["ms"]["step"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--world", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--offloading", action="store_true")
    parser.add_argument("--backends", nargs="*", default=["aot_eager"])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {"config": {"layers": args.layers, "hidden": 64, "batch": BATCH, "seq": SEQ, **BF16,
                               "autocast": "bf16", "optimizer": "AdamW", "rounds": args.rounds,
                               "timer": "time.thread_time, median per step"}}
    previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    if 1 in args.world:
        report["world1"] = world1(args.layers, args.rounds)
        print("world 1:", json.dumps({k: v["ratio_to_plain"] for k, v in report["world1"].items()}))
    if 2 in args.world:
        report["world2"] = world2(args.layers, args.rounds)
        print("world 2:", json.dumps({k: v["ratio_to_fsdp2_per_block"] for k, v in report["world2"].items()}))
    if args.checkpointing:
        report["checkpointing"] = checkpointing(args.layers, args.rounds, args.backends)
    if args.offloading:
        report["offloading"] = offloading(args.layers, args.rounds)
        print("offloading:", json.dumps({k: (v["ratio_to_none"]["step"], v.get("moved_bytes"), v.get("bound_bytes"))
                                          for k, v in report["offloading"].items()}))
    merged = {**previous, **report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
