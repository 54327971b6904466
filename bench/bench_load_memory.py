"""Host memory of loading, saving and exporting a model, per rank, as the kernel counts it.

    python bench/bench_load_memory.py [--layers 24 --hidden 1024 --vocab 32000] [--quick]
                                      [--label after] [--only fsdp,tp,pp,ep,eager,transformers]
                                      [--files fp32-one,fp32-multi,bf16-one,bf16-multi,moe]
                                      [--peers smp,mmap,eager,transformers] [--rounds 3]

Peak resident memory (VmHWM, which RSS-based out-of-memory killers count: private memory and
the file pages a memory-mapped read touched) per rank, above the rank's resident memory just
before the phase (`echo 5 > /proc/self/clear_refs` resets the peak there), divided by the bound
smp documents: model bytes / world + the largest tensor's bytes (the model's dtype). Each case
is its own `torchrun` run at world 2, on folders written once with `save_pretrained` (a ~0.47B
Llama, fp32 and bf16, one file and ~480 MB files; a small Mixtral in the per-expert layout that
transformers converts on load):
  smp          `smp.transform(meta model, weights=folder)` under FSDP 2, TP 2, PP 2, EP 2;
               then (one folder; and Mixtral at EP 2 and TP 2) `save`, `save(async_save=True)`
               (until `wait()`), `export_hf`, and `load` of the saved checkpoint (DCP)
  mmap         the same `smp.transform(meta model, weights=folder)` with the read smp used before
               (DCP's HuggingFaceStorageReader: safetensors' `safe_open`, the file mapped): the
               "before" of an A/B in one run, TP 2 and FSDP 2 on the fp32 folders
  eager        `smp.transform(from_pretrained(folder))` on every rank (what the meta path avoids)
  transformers `from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=2))`, and
               `DistributedConfig(tp_size=2)` (its own distributed loading); every parameter
               is then read once (its shards may still be views of the mapped file)
Wall and CPU (user + system of the rank's process) seconds per phase are reported beside it.
`--rounds N` runs every case N times, the cases in turn within a round and in reverse order in
every other round (smp and mmap interleaved, each first equally often), and reports each
figure's median over rounds with its range (the machine is shared: one round is noise).

Writes bench/results/load_memory[_<label>].json; `--label before` with PYTHONPATH pointing at an
older checkout of smp measures that code with the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PHASES = ("load", "save", "async_save", "export_hf", "dcp_load")
LIMIT = 1.10  # the target: peak above baseline / (model / world + largest tensor)


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel: reused pages would hide a peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _measure(fn) -> tuple[dict, object]:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    base = _reset_peak()
    wall, cpu = time.perf_counter(), _cpu()
    result = fn()
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    peak = _status("VmHWM")
    return {"peak_mib": (peak - base) / 2**20, "settled_mib": (_status("VmRSS") - base) / 2**20,
            "wall_s": wall, "cpu_s": cpu}, result


# ----------------------------------------------------------------------------------------------
# The folders (written once, in the driver)


def _llama_config(a):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                       num_attention_heads=16, num_key_value_heads=16, vocab_size=a.vocab,
                       tie_word_embeddings=False, max_position_embeddings=2048)


def _mixtral_config(a):
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=a.hidden // 2, intermediate_size=a.hidden, num_hidden_layers=max(2, a.layers // 3),
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=a.vocab,
                         num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)


def write_folders(root: str, a) -> dict[str, str]:
    import torch
    from transformers import AutoModelForCausalLM

    folders = {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama_config(a), dtype=torch.float32)
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        for files, shard in (("one", "20GB"), ("multi", "480MB")):
            path = os.path.join(root, f"llama_{dtype}_{files}")
            model.save_pretrained(path, max_shard_size=shard)
            folders[f"{dtype}-{files}"] = path
    del model
    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(_mixtral_config(a), dtype=torch.float32)
    folders["moe"] = os.path.join(root, "mixtral")
    moe.save_pretrained(folders["moe"])  # per-expert w1/w2/w3: converted on load
    return folders


# ----------------------------------------------------------------------------------------------
# One run (under torchrun): one peer, one layout, one folder; each rank writes its report.

SMP_CONFIGS = {"fsdp": {}, "tp": {"tensor_parallel_degree": 2}, "pp": {"pipeline_parallel_degree": 2},
               "ep": {"expert_parallel_degree": 2}}


def _model_bytes(config) -> tuple[int, int]:
    """(bytes of the model's parameters and persistent buffers in fp32, the largest one's)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    return sum(sizes), max(sizes)


def _touch(model) -> None:
    from torch.distributed.tensor import DTensor

    for t in (*model.parameters(), *model.buffers()):
        float((t.to_local() if isinstance(t, DTensor) else t).detach().float().sum())


def _held(model) -> tuple[float, int]:
    """(MiB of parameters and buffers this rank holds, local shards; how many are still on meta)."""
    from torch.distributed.tensor import DTensor

    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if not t.is_meta) / 2**20, sum(t.is_meta for t in local)


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    case = json.loads(a.case)
    folder, peer, layout = case["folder"], case["peer"], case["layout"]
    config = AutoConfig.from_pretrained(folder)
    total, largest = _model_bytes(config)
    report = {"model_mib": total / 2**20, "largest_mib": largest / 2**20}
    if peer == "transformers":
        from transformers.distributed import DistributedConfig

        dist_config = DistributedConfig(fsdp_size=2) if layout == "fsdp" else DistributedConfig(tp_size=2)

        def load():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=dist_config)
            _touch(model)  # its shards may still be views of the mapped file: read each page once, as a step would
            return model
    else:
        import smp

        smp.init(SMP_CONFIGS[layout])
        if peer == "mmap":
            _read_as_before()
        if peer in ("smp", "mmap"):
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

            def load():
                return smp.transform(meta, weights=folder)
        else:  # eager: the whole model on every rank, then sharded

            def load():
                return smp.transform(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    world = int(os.environ["WORLD_SIZE"])
    report["load"], model = _measure(load)
    report["held_mib"], report["on_meta"] = _held(model)
    if case.get("save"):
        import smp

        out = case["out"]
        report["save"], _ = _measure(lambda: smp.checkpointing.save(os.path.join(out, "step"), model))

        def async_save():
            smp.checkpointing.save(os.path.join(out, "step_async"), model, async_save=True)
            smp.checkpointing.wait()
        report["async_save"], _ = _measure(async_save)
        report["export_hf"], _ = _measure(lambda: smp.checkpointing.export_hf(os.path.join(out, "hf"), model))
        report["dcp_load"], _ = _measure(lambda: smp.checkpointing.load(os.path.join(out, "step"), model))
    bound = total / world + largest
    for phase in PHASES:
        if phase in report:
            report[phase]["ratio"] = report[phase]["peak_mib"] * 2**20 / bound
    with open(os.path.join(a.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _read_as_before() -> None:
    """load_hf's plain reads as smp did them before reading by byte range (smp 708f59d): one
    `dcp.load` through DCP's HuggingFaceStorageReader (safetensors' safe_open: each file mapped
    while read). Used for the fp32 Llama folders (no packed or converted tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from smp.checkpointing.hf import load as hf_load

    def read(folder, mapping, state):
        directory = os.path.dirname(next(iter(folder.values())).pieces[0][0].file)
        dcp.load({key: state[target] for key, target in mapping.items()},
                 storage_reader=HuggingFaceStorageReader(directory), no_dist=True)

    hf_load._read_boxes = read


# ----------------------------------------------------------------------------------------------
# The driver


def cases(folders: dict[str, str], a, root: str) -> list[dict]:
    only = set(a.only.split(",")) if a.only else None
    llama = ["fp32-one", "fp32-multi", "bf16-one", "bf16-multi"] if not a.quick else ["fp32-one"]
    out = []
    for layout in ("fsdp", "tp", "pp"):
        for name in llama:
            out.append({"peer": "smp", "layout": layout, "files": name, "folder": folders[name],
                        "save": name == "fp32-multi" or a.quick, "out": os.path.join(root, "out")})
    # Mixtral at EP 2: each rank holds its experts (Shard(0) of the stacked expert weights).
    out.append({"peer": "smp", "layout": "ep", "files": "moe", "folder": folders["moe"], "save": True,
                "out": os.path.join(root, "out")})
    # Mixtral at TP 2: gate_up_proj is a packed tensor-parallel weight (each rank a slice of gate
    # and of up), loaded by placing each expert's slices and exported box by box.
    out.append({"peer": "smp", "layout": "tp", "files": "moe", "folder": folders["moe"], "save": True,
                "out": os.path.join(root, "out")})
    for layout in ("fsdp", "tp"):
        for name in ["fp32-one", "fp32-multi"] if not a.quick else ["fp32-one"]:
            out.append({"peer": "mmap", "layout": layout, "files": name, "folder": folders[name]})
    out.append({"peer": "eager", "layout": "fsdp", "files": "bf16-one", "folder": folders["bf16-one"]})
    for layout in ("fsdp", "tp"):
        for name in (["fp32-one", "fp32-multi"] if not a.quick else ["fp32-one"]):
            out.append({"peer": "transformers", "layout": layout, "files": name, "folder": folders[name]})
    if only:
        out = [c for c in out if c["layout"] in only or c["peer"] in only]
    if a.files:
        out = [c for c in out if c["files"] in a.files.split(",")]
    if a.peers:
        out = [c for c in out if c["peer"] in a.peers.split(",")]
    # Each smp case beside its mmap baseline (same layout and folder): an A/B pair runs back to back.
    return sorted(out, key=lambda c: (c["peer"] not in ("smp", "mmap"), c["layout"], c["files"]))


def run_case(case: dict, script: str) -> list[dict] | str:
    with tempfile.TemporaryDirectory(prefix="smp_load_mem_") as reports:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + os.getpid() % 1000), script, "--worker", "--case", json.dumps(case), "--out", reports]
        env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
        run = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if case.get("out"):
            shutil.rmtree(case["out"], ignore_errors=True)
        if run.returncode:
            return run.stderr[-1500:]
        return [json.load(open(os.path.join(reports, f"rank{r}.json"))) for r in range(2)]


def _one_run(case: dict) -> dict:
    ranks = run_case(case, os.path.abspath(__file__))
    row = {k: case[k] for k in ("peer", "layout", "files")}
    if isinstance(ranks, str):
        return {**row, "error": ranks}
    row["model_mib"], row["largest_mib"] = ranks[0]["model_mib"], ranks[0]["largest_mib"]
    row["held_mib"] = [round(r["held_mib"], 1) for r in ranks]
    row["on_meta"] = [r["on_meta"] for r in ranks]
    for phase in PHASES:
        if phase in ranks[0]:
            row[phase] = {k: [round(r[phase][k], 3) for r in ranks] for k in ranks[0][phase]}
            row[phase]["max_ratio"] = max(row[phase]["ratio"])
    return row


def _over_rounds(runs: list[dict]) -> dict:
    """One case over its rounds: per rank, the median of each figure; `max_ratio` the worst
    round's (the bound must hold every time); `cpu_s_rounds` / `wall_s_rounds` each round's
    mean over the ranks (the spread is the noise)."""
    import statistics

    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    row = {k: v for k, v in runs[0].items() if k not in PHASES}
    for phase in PHASES:
        if phase not in runs[0]:
            continue
        row[phase] = {k: [round(statistics.median(r[phase][k][rank] for r in runs), 3) for rank in range(2)]
                      for k in runs[0][phase] if k != "max_ratio"}
        row[phase]["max_ratio"] = max(r[phase]["max_ratio"] for r in runs)
        for k in ("cpu_s", "wall_s"):
            row[phase][k + "_rounds"] = [round(sum(r[phase][k]) / 2, 3) for r in runs]
    return row


def _ab(results: list[dict]) -> dict:
    """{layout files: {"median", "rounds"}}: smp's load CPU (mean over the ranks) over the mmap
    read's, paired round by round, where both ran."""
    import statistics

    by = {(r["peer"], r["layout"], r["files"]): r for r in results if "error" not in r}
    out = {}
    for (peer, layout, files), row in by.items():
        before = by.get(("mmap", layout, files))
        if peer != "smp" or before is None:
            continue
        ratios = [round(x / y, 3) for x, y in zip(row["load"]["cpu_s_rounds"], before["load"]["cpu_s_rounds"])]
        out[f"{layout} {files}"] = {"median": statistics.median(ratios), "rounds": ratios}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--case")
    p.add_argument("--out")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--quick", action="store_true", help="one folder per layout (a smoke run)")
    p.add_argument("--only", default="", help="comma-separated layouts or peers to run")
    p.add_argument("--files", default="", help="comma-separated folders to run (fp32-one, ..., moe)")
    p.add_argument("--label", default="", help="results file suffix (before / after)")
    p.add_argument("--root", default="", help="reuse the folders written there")
    p.add_argument("--peers", default="", help="comma-separated peers to run (smp, mmap, eager, transformers)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every case, interleaved (medians reported)")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    root = a.root or tempfile.mkdtemp(prefix="smp_bench_load_")
    try:
        if not os.path.isdir(os.path.join(root, "mixtral")):
            folders = write_folders(root, a)
        else:
            folders = {f"{d}-{n}": os.path.join(root, f"llama_{d}_{n}") for d in ("fp32", "bf16") for n in ("one", "multi")}
            folders["moe"] = os.path.join(root, "mixtral")
        todo = cases(folders, a, root)
        runs: list[list[dict]] = [[] for _ in todo]
        for round_ in range(a.rounds):
            order = list(range(len(todo)))
            for i in order if round_ % 2 == 0 else order[::-1]:
                row = _one_run(todo[i])
                print(json.dumps({"round": round_, **row}), flush=True)
                runs[i].append(row)
        results = [_over_rounds(case_runs) for case_runs in runs]
        ab = _ab(results)
        RESULTS.mkdir(exist_ok=True)
        name = f"load_memory{'_' + a.label if a.label else ''}.json"
        smp_rows = [r for r in results if r.get("peer") == "smp"]
        summary = {
            "target": LIMIT,
            "met": all("error" not in r and all(r[ph]["max_ratio"] <= LIMIT for ph in PHASES if ph in r)
                       for r in smp_rows),
        }
        (RESULTS / name).write_text(json.dumps({
            "command": "python bench/bench_load_memory.py " + " ".join(sys.argv[1:]),
            "machine": f"{os.cpu_count()} CPUs, torch on CPU (gloo), world 2",
            "summary": summary, "rounds": a.rounds, "cpu_smp_over_mmap": ab, "cases": results}, indent=1))
        print(json.dumps(summary))
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
