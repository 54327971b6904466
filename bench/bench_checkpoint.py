"""Checkpoint save / load time and bytes for a few model sizes, sync vs async, in one run.

    torchrun --standalone --nproc-per-node 2 bench/bench_checkpoint.py [--sizes 256x4,512x8,1024x8]

For each tiny-Llama size (hidden x layers, AdamW state included) and each mode:
  - sync save: the time the training loop is blocked = the whole save;
  - async save: the time `save(..., async_save=True)` blocks (the host copy) and the time
    until `wait()` sees the checkpoint committed;
  - load (into a freshly transformed model and optimizer) and export_hf;
  - bytes on disk of the checkpoint and of the export.
Median of --repeats runs, rank 0's clock after a barrier. Writes bench/results/checkpoint_w{N}.json.

    torchrun --standalone --nproc-per-node 2 bench/bench_checkpoint.py --digest

instead compares sync save and load with file digests (what smp does: each rank hashes the
files it writes as DCP writes them, and checks them from the bytes DCP reads) against the same
calls with every hash skipped ('hash_off': the cost of the digests alone) and against DCP's own
writer and reader ('dcp'), each round in another of the six orders, so that each mode runs
first, second and third equally often and after each other mode equally often (median of
--repeats rounds, a multiple of 6, after a warm-up round, and
the median of the per-round ratios with its 95% bootstrap interval: on a shared machine single
rounds differ by up to 2x, so the interval says what the rounds can resolve; an os.sync() before
each timed operation). --repeats takes one count or one per size (e.g. 60,36,18). Each load runs twice: from the
page cache, right after its save, and cold (the files dropped from the page cache with
posix_fadvise, as after a restart). Three more rounds count the seconds spent inside the hash
function (the digests' own cost, free of the disk's noise). All next to this disk's write
bandwidth (a dd-like 512 MiB write + fdatasync into --dir). Writes bench/results/checkpoint_digest.json
(world 2; other world sizes: checkpoint_digest_w<N>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import smp
from torch.distributed.checkpoint import FileSystemWriter

from smp.checkpointing.trust import digest, inline_digest, safe_read
from smp.testing.models import tiny_llama_config


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _build(hidden: int, layers: int):
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                            num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                            vocab_size=32000)
    model = smp.transform(LlamaForCausalLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(), opt.zero_grad()  # optimizer state exists, as in a real run
    return model, opt, sum(p.numel() for p in model.parameters())


def bench_size(hidden: int, layers: int, root: str, repeats: int) -> dict:
    model, opt, n_params = _build(hidden, layers)
    ck = smp.checkpointing
    sync, blocked, total, load, export = [], [], [], [], []
    for i in range(repeats):
        path = os.path.join(root, f"s{hidden}_{i}")
        sync.append(_timed(lambda: ck.save(path + "_sync", model, opt, extra={"step": i})))
        t0 = time.perf_counter()
        blocked.append(_timed(lambda: ck.save(path + "_async", model, opt, extra={"step": i}, async_save=True)))
        ck.wait()
        dist.barrier()
        total.append(time.perf_counter() - t0)
        fresh, fresh_opt, _ = _build(hidden, layers)
        load.append(_timed(lambda: ck.load(path + "_sync", fresh, fresh_opt)))
        export.append(_timed(lambda: ck.export_hf(path + "_hf", model)))
        del fresh, fresh_opt
    sample = os.path.join(root, f"s{hidden}_0")
    row = {
        "hidden": hidden, "layers": layers, "params": n_params,
        "checkpoint_bytes": _dir_bytes(sample + "_sync"), "export_bytes": _dir_bytes(sample + "_hf"),
        "sync_save_s": statistics.median(sync), "async_save_blocked_s": statistics.median(blocked),
        "async_save_total_s": statistics.median(total), "load_s": statistics.median(load),
        "export_hf_s": statistics.median(export),
    }
    dist.barrier()
    if dist.get_rank() == 0:
        for i in range(repeats):
            for suffix in ("_sync", "_async", "_hf"):
                shutil.rmtree(os.path.join(root, f"s{hidden}_{i}{suffix}"), ignore_errors=True)
    return row


def disk_write_mb_s(root: str, mib: int = 512) -> float:
    """(rank 0) Sequential write + fdatasync of `mib` MiB of random bytes, as `dd conv=fdatasync`."""
    block = os.urandom(8 * 2**20)
    file = os.path.join(root, "dd_probe")
    t = time.perf_counter()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(mib // 8):
            os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    os.remove(file)
    return mib * 2**20 / 1e6 / seconds


class _PlainWriter(FileSystemWriter):
    """DCP's own writer in place of smp's hashing one: no digests recorded."""

    def __init__(self, path, algo, **kwargs):
        super().__init__(path, **kwargs)
        self.written_digests: dict = {}


class _PlainReader(safe_read.SafeReader):
    """DCP's reader (with smp's allow-listed metadata) in place of the verifying one."""

    def __init__(self, path, expected):
        super().__init__(path)
        self.checked = dict.fromkeys(expected)  # "all matched": nothing is hashed afterwards


class _NoHash:
    """In place of `digest.Hasher`: every digest is the same constant."""

    def __init__(self, algo: str):
        self.algo = algo

    def update(self, chunk) -> None:
        pass

    def result(self) -> str:
        return f"{self.algo}:skipped"


class _TimedHasher:
    """`digest.Hasher` that adds the seconds spent hashing to `_TimedHasher.seconds`: the cost
    of the digests themselves, free of the disk's noise."""

    seconds = 0.0

    def __init__(self, algo: str):
        self._hasher = _REAL_HASHER(algo)

    def update(self, chunk) -> None:
        t = time.perf_counter()
        self._hasher.update(chunk)
        _TimedHasher.seconds += time.perf_counter() - t

    def result(self) -> str:
        return self._hasher.result()


_REAL_HASHER = digest.Hasher


@contextlib.contextmanager
def _mode(mode: str):
    """'verified': smp as it is. 'hash_off': the same save and load, every hash skipped (the
    cost of the digests alone). 'dcp': DCP's own writer and reader, no hashing streams (smp
    before digests). 'timed': 'verified' counting the seconds spent hashing (its per-call clock
    reads cost time of their own, so it runs apart from the timed comparison)."""
    saved = (digest.Hasher, digest.file_digest, digest.mismatch, inline_digest.HashingWriter,
             inline_digest.VerifyingReader)
    if mode == "timed":  # verified, with the time inside the hash function counted
        digest.Hasher = _TimedHasher
    elif mode != "verified":
        digest.Hasher = _NoHash
        digest.file_digest = lambda path, algo: f"{algo}:skipped"
        digest.mismatch = lambda entry, size, found: None  # loads the verified save's folder
    if mode == "dcp":
        inline_digest.HashingWriter, inline_digest.VerifyingReader = _PlainWriter, _PlainReader
    try:
        yield
    finally:
        (digest.Hasher, digest.file_digest, digest.mismatch, inline_digest.HashingWriter,
         inline_digest.VerifyingReader) = saved


def median_ci(values: list[float], level: float = 0.95, resamples: int = 4000) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of `values` (a fixed seed: reruns agree)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(resamples * (1 - level) / 2)], medians[int(resamples * (1 + level) / 2) - 1]


def pooled_slowdowns(rows: list[dict]) -> dict[str, dict]:
    """Verified vs hash off over the rounds of every size together, per operation and over all:
    median of the per-round ratios and its 95% interval (the rows' own intervals are wide)."""
    kinds = {"save": ("save",), "load": ("load",), "load_cold": ("load_cold",), "all": ("save", "load", "load_cold")}
    result = {}
    for name, whats in kinds.items():
        ratios = [v / h - 1 for r in rows for what in whats
                  for v, h in zip(r[f"{what}_verified_each_s"], r[f"{what}_hash_off_each_s"])]
        result[name] = {"rounds": len(ratios), "paired_slowdown": statistics.median(ratios),
                        "paired_slowdown_ci95": median_ci(ratios)}
    return result


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _evict(directory: str) -> None:
    """Drop a checkpoint's files from the page cache (DCP fsyncs them, so they are clean): the
    next load reads from the disk, as a resume after a restart does. Every rank evicts all."""
    dist.barrier()
    for parent, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    dist.barrier()


def bench_digest(hidden: int, layers: int, root: str, repeats: int) -> dict:
    model, opt, n_params = _build(hidden, layers)
    fresh, fresh_opt, _ = _build(hidden, layers)
    ck = smp.checkpointing
    # Wall seconds, and CPU seconds of the busiest rank (all its threads).
    kinds = ("save", "load", "load_cold")
    modes = ("verified", "hash_off", "dcp")
    times: dict[str, dict[str, list[float]]] = {
        m: {k + suffix: [] for k in kinds for suffix in ("", "_cpu", "_hash")} for m in modes + ("timed",)}

    def measure(mode: str, i: int, what: str, op) -> None:
        os.sync()  # no other save's writeback in flight: each op starts from the same state
        with _mode(mode):
            cpu, _TimedHasher.seconds = time.process_time(), 0.0
            seconds = _timed(op)
            cpu, hashing = time.process_time() - cpu, _TimedHasher.seconds
        if i > 0:
            times[mode][what].append(seconds)
            times[mode][what + "_cpu"].append(_max_over_ranks(cpu))
            times[mode][what + "_hash"].append(_max_over_ranks(hashing))

    def round_(i: int, order: tuple[str, ...]) -> None:
        """Every mode saves to a folder of its own; then every mode loads the verified save's
        folder (other folders sit elsewhere on the disk, which alone moved cold loads by up to
        +-60% here), from the page cache and then cold. Each of the three phases starts with an
        untimed operation: the first of a phase ran up to 2x slower here, whatever its mode
        (one mode's median then depended on how often it came first)."""
        scratch = os.path.join(root, f"d{hidden}_scratch_{i}")
        os.sync()
        ck.save(scratch, model, opt, extra={"step": i})
        for mode in order:
            path = os.path.join(root, f"d{hidden}_{mode}_{i}")
            measure(mode, i, "save", lambda: ck.save(path, model, opt, extra={"step": i}))
        shared = os.path.join(root, f"d{hidden}_{order[0] if order == ('timed',) else 'verified'}_{i}")
        for what in ("load", "load_cold"):
            if what == "load_cold":
                _evict(scratch)
            ck.load(scratch, fresh, fresh_opt)
            for mode in order:
                if what == "load_cold":
                    _evict(shared)
                measure(mode, i, what, lambda: ck.load(shared, fresh, fresh_opt))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
            for mode in order:
                if (i, mode) != (1, "verified"):  # kept: hashed below
                    shutil.rmtree(os.path.join(root, f"d{hidden}_{mode}_{i}"), ignore_errors=True)

    # Round 0 is a warm-up, not measured: the first save and load of a process pay for page
    # faults and allocator growth (~2x slower), which would land on whichever mode ran first.
    # Each round takes the next of the six orders: every mode runs first, second and third
    # equally often (a save that follows two others ran up to 2x slower here, whatever it was)
    # and right after each other mode equally often (with three rotations only, verified
    # mostly followed DCP and hash off mostly followed verified; its cold loads then came out
    # 5-20% slower than hash off's, while alternating the two alone showed +0.1% to +5.1%).
    orders = list(itertools.permutations(modes))
    for i in range(repeats + 1):
        round_(i, orders[i % len(orders)])
    for i in range(1, 4):
        round_(i, ("timed",))
    sample = os.path.join(root, f"d{hidden}_verified_1")
    size = _dir_bytes(sample)
    # The hashing itself, on one rank, all files (a save or load splits it over the ranks):
    # robust to the disk noise that the end-to-end times carry on a shared machine.
    files = digest.data_files(sample, frozenset({"smp_meta.json", "smp_commit.json", "smp_partial.json"}))
    t = time.perf_counter()
    digest.describe(sample, files, digest.algorithm())
    hash_s = time.perf_counter() - t
    row = {"hidden": hidden, "layers": layers, "params": n_params, "checkpoint_bytes": size,
           "digest_algorithm": digest.algorithm(), "hash_all_files_one_rank_s": hash_s,
           "hash_mb_s": size / 1e6 / hash_s, "mode_order_each": [orders[i % len(orders)] for i in range(1, repeats + 1)]}
    for mode, t in times.items():
        for what in kinds:
            seconds = statistics.median(t[what])
            row[f"{what}_{mode}_s"] = seconds
            row[f"{what}_{mode}_each_s"] = [round(x, 4) for x in t[what]]
            row[f"{what}_{mode}_mb_s"] = size / 1e6 / seconds
            row[f"{what}_{mode}_cpu_s"] = statistics.median(t[what + "_cpu"])
    for what in kinds:  # verified vs the same without hashing; vs DCP's own streams
        row[f"{what}_slowdown"] = row[f"{what}_verified_s"] / row[f"{what}_hash_off_s"] - 1
        # Median of the per-round ratios (both modes of a round share its disk and neighbours),
        # with the interval that the spread of the rounds leaves it.
        for base in ("hash_off", "dcp"):
            ratios = [v / b - 1 for v, b in zip(times["verified"][what], times[base][what])]
            name = "paired_slowdown" if base == "hash_off" else "paired_vs_dcp"
            row[f"{what}_{name}"] = statistics.median(ratios)
            row[f"{what}_{name}_ci95"] = median_ci(ratios)
        row[f"{what}_cpu_slowdown"] = row[f"{what}_verified_cpu_s"] / row[f"{what}_hash_off_cpu_s"] - 1
        row[f"{what}_vs_dcp"] = row[f"{what}_verified_s"] / row[f"{what}_dcp_s"] - 1
        # Seconds the busiest rank spent inside the hash function, as a share of the operation.
        timed = times["timed"]
        row[f"{what}_hash_s"] = statistics.median(timed[what + "_hash"])
        row[f"{what}_hash_share"] = statistics.median(h / v for h, v in zip(timed[what + "_hash"], timed[what]))
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(root):
            if name.startswith(f"d{hidden}_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="256x4,512x8,1024x8", help="hidden x layers, comma separated")
    parser.add_argument("--repeats", default="3", help="rounds: one count, or one per size")
    parser.add_argument("--hybrid", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--digest", action="store_true", help="save/load with vs without file digests")
    args = parser.parse_args()
    torch.set_num_threads(1)
    smp.init({"hybrid_shard_degree": args.hybrid})
    root = args.dir or (tempfile.mkdtemp(prefix="smp_ckpt_bench_") if dist.get_rank() == 0 else None)
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    if args.digest:
        _main_digest(args, root)
        return
    rows = []
    for size, repeats in zip(args.sizes.split(","), _repeats(args)):
        hidden, layers = (int(x) for x in size.split("x"))
        rows.append(bench_size(hidden, layers, root, repeats))
        if dist.get_rank() == 0:
            r = rows[-1]
            print(f"{r['params'] / 1e6:7.1f}M params  ckpt {r['checkpoint_bytes'] / 2**20:8.1f} MiB  "
                  f"sync save {r['sync_save_s']:.3f}s  async blocks {r['async_save_blocked_s']:.3f}s "
                  f"(done {r['async_save_total_s']:.3f}s)  load {r['load_s']:.3f}s  "
                  f"export_hf {r['export_hf_s']:.3f}s ({r['export_bytes'] / 2**20:.1f} MiB)", flush=True)
    if dist.get_rank() == 0:
        out = Path(__file__).parent / "results" / f"checkpoint_w{dist.get_world_size()}.json"
        out.write_text(json.dumps({
            "world_size": dist.get_world_size(), "config": {"hybrid_shard_degree": args.hybrid},
            "torch": torch.__version__, "storage": "local disk (virtio block device)",
            "command": f"torchrun --standalone --nproc-per-node {dist.get_world_size()} "
                       f"bench/bench_checkpoint.py --sizes {args.sizes} --repeats {args.repeats}",
            "rows": rows,
        }, indent=1))
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    smp.shutdown()


def _repeats(args) -> list[int]:
    counts = [int(x) for x in args.repeats.split(",")]
    sizes = args.sizes.split(",")
    if len(counts) not in (1, len(sizes)):
        raise SystemExit(f"--repeats {args.repeats}: give one count or one per size ({len(sizes)})")
    return counts * len(sizes) if len(counts) == 1 else counts


def _main_digest(args, root: str) -> None:
    disk = [disk_write_mb_s(root) if dist.get_rank() == 0 else 0.0]
    dist.broadcast_object_list(disk, src=0)
    rows = []
    for size, repeats in zip(args.sizes.split(","), _repeats(args)):
        hidden, layers = (int(x) for x in size.split("x"))
        rows.append(bench_digest(hidden, layers, root, repeats))
        if dist.get_rank() == 0:
            r = rows[-1]
            print(f"{r['params'] / 1e6:7.1f}M params  ckpt {r['checkpoint_bytes'] / 2**20:8.1f} MiB  " + "  ".join(
                f"{what} {r[f'{what}_verified_s']:.3f}s / hash off {r[f'{what}_hash_off_s']:.3f}s "
                f"({r[f'{what}_slowdown']:+.1%}, paired {r[f'{what}_paired_slowdown']:+.1%} "
                f"[{r[f'{what}_paired_slowdown_ci95'][0]:+.1%}, {r[f'{what}_paired_slowdown_ci95'][1]:+.1%}], "
                f"hashing {r[f'{what}_hash_s']:.3f}s = {r[f'{what}_hash_share']:.1%}, "
                f"CPU {r[f'{what}_cpu_slowdown']:+.1%}) / DCP {r[f'{what}_dcp_s']:.3f}s"
                for what in ("save", "load", "load_cold")) + "  "
                  f"disk {disk[0]:.0f} MB/s  hashing {r['hash_mb_s']:.0f} MB/s", flush=True)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        out = Path(__file__).parent / "results" / ("checkpoint_digest.json" if world == 2 else f"checkpoint_digest_w{world}.json")
        out.write_text(json.dumps({
            "world_size": dist.get_world_size(), "torch": torch.__version__,
            "disk_write_mb_s": disk[0], "disk_probe": "512 MiB sequential write + fdatasync into --dir",
            "command": f"torchrun --standalone --nproc-per-node {dist.get_world_size()} "
                       f"bench/bench_checkpoint.py --digest --sizes {args.sizes} --repeats {args.repeats}",
            "rows": rows, "pooled": pooled_slowdowns(rows),
        }, indent=1))
        for name, p in pooled_slowdowns(rows).items():
            lo, hi = p["paired_slowdown_ci95"]
            print(f"pooled {name}: verified vs hash off {p['paired_slowdown']:+.1%} [{lo:+.1%}, {hi:+.1%}] "
                  f"over {p['rounds']} rounds", flush=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    smp.shutdown()


if __name__ == "__main__":
    main()
