"""Context parallel: what the attention probe (smp/context_parallel/probe.py) costs.

    python bench/bench_cp_probe.py [--repeats 7]

At world 2, context_parallel_degree 2, on the tests' tiny Llama (hidden 32, 2 layers, GQA 4/2,
sequences of 16 tokens) and on Llamas of hidden 256 with 2 and 8 layers (sequences of 256; the
probe's cost follows the number of operators, not the tensor sizes), per rank, medians over
`--repeats` fresh models:
- the first forward (+ backward) with the probe, and without it (the hook left out);
- the probe alone (`probe_forward` on the first forward's inputs);
- a later step (forward + backward), for scale.

Writes bench/results/context_parallel_probe.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smp
from smp.context_parallel import shard_batch
from smp.context_parallel.attention import active
from smp.context_parallel.hf import LOSS_INPUTS
from smp.context_parallel.probe import meta_stand_ins, probe_forward
from smp.testing.models import tiny_llama
from smp.testing.rank_pool import RankPool

MODELS = {
    "tests_tiny_llama": (dict(vocab_size=128, hidden_size=32, intermediate_size=64), 16),
    **{f"llama_h256_l{layers}": (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=4096), 256) for layers in (2, 8)},
}


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_forward(name: str, probe: bool, repeats: int) -> dict:
    """Per-rank medians (seconds): first forward + backward, probe alone, a later step."""
    overrides, seq = MODELS[name]
    transform_module = importlib.import_module("smp.transform")
    installed = transform_module.install_attention_probe
    first, alone, later = [], [], []
    with smp.session({"context_parallel_degree": 2}):
        ids = torch.randint(0, overrides["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
        batch = shard_batch(ids)
        for _ in range(repeats):
            torch.manual_seed(0)
            if not probe:
                transform_module.install_attention_probe = lambda model, cp_probe: None
            try:
                model = smp.transform(tiny_llama(**overrides))
            finally:
                transform_module.install_attention_probe = installed
            first.append(_timed(lambda: model(**batch).loss.backward()))
            later.append(_timed(lambda: model(**batch).loss.backward()))
            if probe:  # as the hook runs it: the loss inputs left out
                stand_ins = meta_stand_ins(tiny_llama(**overrides))
                inputs = {k: v for k, v in batch.items() if k not in LOSS_INPUTS}
                alone.append(_timed(lambda: probe_forward(model, stand_ins, active(), (), inputs)))
    out = {"first_forward_backward_s": statistics.median(first), "later_step_s": statistics.median(later)}
    if probe:
        out["probe_alone_s"] = statistics.median(alone)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="bench/results/context_parallel_probe.json")
    args = p.parse_args()
    result: dict = {"command": f"python bench/bench_cp_probe.py --repeats {args.repeats}", "world": 2, "cp": 2}
    pool = RankPool(2)
    try:
        for name in MODELS:
            with_probe = pool.run(first_forward, name=name, probe=True, repeats=args.repeats, timeout=1200)[0]
            without = pool.run(first_forward, name=name, probe=False, repeats=args.repeats, timeout=1200)[0]
            result[name] = {
                "seq": MODELS[name][1], "with_probe": with_probe, "without_probe": without,
                "first_forward_added_s": with_probe["first_forward_backward_s"] - without["first_forward_backward_s"],
            }
            print(json.dumps({name: result[name]}), flush=True)
    finally:
        pool.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
