"""Activation memory and step time: none / full / selective / offload, side by side in one run.

    python bench/bench_activations.py [--seqs 128 256 512] [--steps 5] [--layers 4]

One Llama-shaped model (transformers LlamaConfig) per mode, same init, same batches; steps
alternate between the modes (A, B, C, ... A, B, C) so machine noise hits all alike. Per
sequence length and mode it reports:
- saved-activation bytes per block and in total: storages created in forward and still alive
  when backward starts (`SavedActivationMeter`; parameters and host copies left out);
- for offloading: bytes moved to host, and the most blocks brought back at once in backward
  (bounded by `activation_loading_horizon`);
- matmuls run in backward (counted with a TorchDispatchMode; the excess over `none` is
  recompute) and the fastest step time (forward + backward; median kept too) relative to `none`:
  wall time on CUDA, process CPU time on CPU (robust to other jobs on shared cores).
On CUDA it also reports peak allocated memory per mode. Writes bench/results/activations.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from smp.activations import apply_activation_checkpointing, apply_activation_offloading
from smp.activations.accounting import OpCounter, SavedActivationMeter, parameter_ptrs
from smp.activations.offloading import offload_stats
from smp.config import load_config
from smp.sharding import find_blocks
from smp.testing.models import tiny_llama_config

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm")


def modes(horizon: int, min_bytes: int) -> dict[str, dict]:
    offload = {"activation_offloading": True, "activation_loading_horizon": horizon,
               "activation_offload_min_bytes": min_bytes}
    return {
        "none": {},
        "full": {"activation_checkpointing": "full"},
        "selective": {"activation_checkpointing": "selective"},
        "offload": offload,
        "offload+full": {**offload, "activation_checkpointing": "full"},
    }


def build(base: torch.nn.Module, config: dict, device: torch.device):
    model = copy.deepcopy(base).to(device)
    blocks = find_blocks(model)
    cfg = load_config(config)
    ac = cfg.activation_checkpointing
    apply_activation_checkpointing(model, blocks, mode=ac.mode, every_n_layers=ac.every_n_layers, save_ops=ac.save_ops)
    if cfg.activation_offloading:
        apply_activation_offloading(
            model, blocks, horizon=cfg.activation_loading_horizon, min_bytes=cfg.activation_offload_min_bytes
        )
    return model, blocks


def measure(model, blocks, batch) -> dict:
    offloader = getattr(model, "_smp_activation_offloader", None)
    if offloader is not None:
        offloader.stats.reset()
    host_bytes = offloader.host_bytes if offloader else (lambda: 0)
    with SavedActivationMeter(blocks, host_bytes) as meter:
        loss = model(input_ids=batch, labels=batch).loss
        exclude = parameter_ptrs(model) | (offloader.host_storage_ptrs() if offloader else set())
        live = meter.live_bytes(exclude)
        with OpCounter() as counter:
            loss.backward()
    model.zero_grad(set_to_none=True)
    out = {
        "peak_step_bytes": meter.peak_bytes,
        "block_bytes": sum(live.per_layer),
        "block_bytes_per_layer": live.per_layer,
        "other_bytes": live.other,
        "backward_matmuls": sum(counter.counts[op] for op in MATMULS),
    }
    stats = offload_stats(model)
    if stats is not None:
        out["offloaded_bytes"] = stats.total_offloaded_bytes
        out["max_layers_resident_in_backward"] = stats.max_layers_resident
        out["demand_loads"] = stats.demand_loads
    return out


def step(model, batch, device) -> float:
    """Seconds for forward + backward: wall time on CUDA; on CPU this process's CPU time, which
    other jobs sharing the cores do not inflate (one intra-op thread, so it is the step's work)."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    model(input_ids=batch, labels=batch).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = clock() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def peak_cuda_bytes(model, batch) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(input_ids=batch, labels=batch).loss.backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=2)
    parser.add_argument("--min-bytes", type=int, default=64 << 10, help="activation_offload_min_bytes")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=2048,
        max_position_embeddings=max(args.seqs), use_cache=False,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    configs = modes(args.horizon, args.min_bytes)
    results = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {args.threads} thread(s)",
        "torch": torch.__version__,
        "model": f"Llama hidden {args.hidden}, {args.layers} layers, batch {args.batch}, fp32",
        "step_clock": "wall" if device.type == "cuda" else "process CPU time",
        "horizon": args.horizon, "min_bytes": args.min_bytes, "steps": args.steps, "by_seq": {},
    }
    for seq in args.seqs:
        models = {name: build(base, config, device) for name, config in configs.items()}
        gen = torch.Generator().manual_seed(seq)
        batch = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=gen).to(device)
        rows = {name: measure(model, blocks, batch) for name, (model, blocks) in models.items()}
        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(args.steps + 1):
            for name, (model, _) in models.items():
                elapsed = step(model, batch, device)
                if i > 0:  # first round is warm-up
                    times[name].append(elapsed)
        none = rows["none"]
        for name, row in rows.items():
            # The fastest step is the one least disturbed by other jobs (caches, memory bandwidth).
            row["step_s"] = min(times[name])
            row["step_s_median"] = statistics.median(times[name])
            row["step_time_ratio"] = row["step_s"] / min(times["none"])
            row["block_bytes_ratio"] = row["block_bytes"] / none["block_bytes"]
            row["peak_step_bytes_ratio"] = row["peak_step_bytes"] / none["peak_step_bytes"]
            row["recomputed_matmuls"] = row["backward_matmuls"] - none["backward_matmuls"]
            if device.type == "cuda":
                row["peak_cuda_bytes"] = peak_cuda_bytes(models[name][0], batch)
        results["by_seq"][str(seq)] = rows
        print(f"seq {seq}")
        for name, row in rows.items():
            extra = ""
            if "offloaded_bytes" in row:
                extra = (f"  offloaded {row['offloaded_bytes'] / 2**20:.2f} MiB, "
                         f"max {row['max_layers_resident_in_backward']}/{args.layers} blocks back")
            print(f"  {name:13s} blocks keep {row['block_bytes'] / 2**20:7.2f} MiB "
                  f"({row['block_bytes_ratio']:.3f} of none), step peak "
                  f"{row['peak_step_bytes'] / 2**20:7.2f} MiB ({row['peak_step_bytes_ratio']:.2f})  step {row['step_s']:.3f} s "
                  f"(x{row['step_time_ratio']:.2f})  recomputed matmuls {row['recomputed_matmuls']}{extra}")
        del models
    out = Path(__file__).parent / "results" / "activations.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
