"""What the network benchmarks share (bench_sync_step.py, bench_parameter_gather.py,
bench_collectives.py): the same Llama trained once per setting, timed in interleaved rounds with
the bytes this node's NIC sent (emulated links, bench/emulated_cluster.py), and where each
result file goes.

Rounds: every setting runs `steps_per_round` steps, then the next setting (A B C, A B C, ...),
so that machine noise hits them alike; round 0 warms up and is not counted. Each step sees the
same global batch for every setting (seeded by round and step), is timed between two barriers,
and the world mean of its loss is kept (the last one is the setting's final loss).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import smp
from emulated_cluster import nic_tx_bytes  # bench/ is on sys.path when run as a script
from smp.testing.models import tiny_llama_config

RESULTS = Path(__file__).parent / "results"


def add_model_arguments(parser: argparse.ArgumentParser, steps_per_round: int) -> None:
    """The rounds and the Llama's size (a large vocabulary and a short batch: many bytes to move
    next to little compute)."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=steps_per_round)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=32)


def llama_config(args: argparse.Namespace):
    return tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab, max_position_embeddings=args.seq,
    )


@dataclass
class Trained:
    """One setting's model (built in its own smp session), its optimizer and its data rows."""

    model: torch.nn.Module
    optim: torch.optim.Optimizer
    dp_rank: int
    dp_size: int


def build_models(settings: dict[str, dict], cfg, inspect: Callable[[str, torch.nn.Module], None] | None = None,
                 ) -> dict[str, Trained]:
    """A Llama of `cfg` through smp.transform under each setting's smp config, all from the same
    initial weights. `inspect(name, model)` runs inside the setting's session (smp.state is its).
    The process group is initialised first: smp.init adopts it and smp.shutdown leaves it (and
    the mesh's subgroups, which each model keeps) alone, so each setting only rebuilds the mesh."""
    from transformers import LlamaForCausalLM

    models = {}
    for name, config in settings.items():
        smp.init(config)
        torch.manual_seed(0)  # the same initial weights for every setting
        model = smp.transform(LlamaForCausalLM(cfg))
        if inspect is not None:
            inspect(name, model)
        models[name] = Trained(model, torch.optim.SGD(model.parameters(), lr=1e-2), smp.state.dp_rank, smp.state.dp_size)
        smp.shutdown()
    return models


@dataclass
class Timed:
    """Per setting, over the counted rounds: step times, NIC bytes sent per step (emulated nodes
    only), the bytes `counter` counted per step, and the final world-mean loss."""

    step_s: dict[str, list[float]] = field(default_factory=dict)
    nic: dict[str, list[int]] = field(default_factory=dict)
    counted: dict[str, list[int]] = field(default_factory=dict)
    final_loss: dict[str, float] = field(default_factory=dict)

    def median_step_s(self, name: str) -> float:
        return statistics.median(self.step_s[name])

    def nic_tx_bytes_per_step(self, name: str) -> float | None:
        return statistics.median(self.nic[name]) if self.nic[name] else None

    def counted_per_step(self, name: str) -> float:
        return statistics.median(self.counted[name])


def interleaved_rounds(models: dict[str, Trained], rounds: int, steps_per_round: int, vocab: int, seq: int,
                       counter: Callable[..., dict[str, Any]]) -> Timed:
    """Train every setting in turn, round by round (round 0 warms up), one sequence per
    data-parallel rank. `counter(reset=True)` zeroes smp's byte counter before each step and
    `counter()["total"]` reads it after (smp.gradient_sync_bytes, parameter_gather_bytes)."""
    timed = Timed({n: [] for n in models}, {n: [] for n in models}, {n: [] for n in models})
    world = dist.get_world_size()
    for rnd in range(rounds + 1):
        for name, run in models.items():
            for step in range(steps_per_round):
                g = torch.Generator().manual_seed(1000 * rnd + step)
                batch = torch.randint(0, vocab, (run.dp_size, seq), generator=g)[run.dp_rank : run.dp_rank + 1]
                counter(reset=True)
                dist.barrier()
                tx0, t0 = nic_tx_bytes(), time.perf_counter()
                loss = run.model(input_ids=batch, labels=batch).loss
                loss.backward()
                run.optim.step()
                run.optim.zero_grad()
                dist.barrier()
                dt = time.perf_counter() - t0
                if rnd:
                    timed.step_s[name].append(dt)
                    if tx0 is not None:
                        timed.nic[name].append(nic_tx_bytes() - tx0)
                    timed.counted[name].append(counter()["total"])
                last = loss.detach().float().clone()
                dist.all_reduce(last)
                timed.final_loss[name] = float(last) / world
    return timed


def emulated_link_mbit() -> str | None:
    """The NICs' rate in Mbit/s when bench/emulated_cluster.py runs the job, else None."""
    return os.environ.get("SMP_EMULATED_LINK_MBIT")


def run_fields(args: argparse.Namespace, params: int) -> dict:
    """The result file's description of the run: the emulated link, the model and the rounds."""
    mbit = emulated_link_mbit()
    return dict(
        emulated_link_mbit=float(mbit) if mbit else None, params=params,
        model=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seq=args.seq),
        rounds=args.rounds, steps_per_round=args.steps_per_round, torch=torch.__version__,
    )


def nic_cell(value: float | None, width: int) -> str:
    """A table cell of NIC bytes, `-` where there is no emulated NIC to read."""
    return f"{value:>{width}.0f}" if value is not None else f"{'-':>{width}}"


def write_result(stem: str, result: dict, link_suffix: bool = True) -> Path:
    """Write bench/results/<stem>[_emulated<M>mbit].json (the suffix on emulated nodes, unless
    `link_suffix` is off) and say where."""
    mbit = emulated_link_mbit()
    suffix = f"_emulated{mbit}mbit" if mbit and link_suffix else ""
    out = RESULTS / f"{stem}{suffix}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out
