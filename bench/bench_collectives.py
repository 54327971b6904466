"""Gradient reduce-scatter: the process group's own vs smp_collectives' ring / int8 / fp8,
side by side in one run; then quantisation kernel throughput (the unfused torch chain vs
smp_collectives' torch path on CPU, vs the fused Triton kernels on GPUs).

    torchrun --standalone --nproc-per-node 2 bench/bench_collectives.py [--sizes-mib 1 4 16 64] [--reps 3]
    torchrun --standalone --nproc-per-node 4 bench/bench_collectives.py
    torchrun --standalone --nproc-per-node 2 bench/bench_collectives.py --sizes-mib --kernel-mib 0 --train-steps 200
    # bandwidth-bound: N emulated nodes with 1 Gbit/s NICs (root; see emulated_cluster.py)
    sudo python bench/emulated_cluster.py --nodes 4 --link-mbit 1000 -- bench/bench_collectives.py --kernel-mib 0

For each fp32 bucket size S (MiB of the reduce-scatter input per rank) and algorithm, the
algorithms run interleaved (default, ring, int8, fp8, default, ...) so that machine noise hits
them alike; a barrier aligns ranks before each call and the reported time is the median over
repetitions of the slowest rank's time. Bytes are what this rank put on the wire, counted by
`smp_collectives.counters`; the process group's own collective is not instrumented, so its row
shows the bandwidth-optimal (N-1)/N x S. On emulated nodes the NIC's own transmit counter is
reported too (everything sent, TCP headers included): it shows what gloo's reduce-scatter
really sends (2x the bound). `link_ms` models the wire time at --link-gbps (default 100 Gbit/s,
an EFA-class link per rank; the emulated rate when run by emulated_cluster.py). Backend: NCCL
when CUDA is available (one GPU per rank), else gloo. Writes
bench/results/collectives_w{N}_{backend}[_emulated{M}mbit].json.

`--train-steps K` adds the training effect: a tiny Llama trained K AdamW steps through
smp.transform with each gradient_sync setting (same init, same batches), mean loss of the
last 20 steps vs fp32 sync (written to collectives_train_w{N}_{backend}.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import rounds  # bench/ is on sys.path when run as a script
import smp_collectives as sc
from emulated_cluster import nic_tx_bytes
from smp_collectives import counters

ALGORITHMS = ("default", "ring", "int8", "fp8")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(algorithm: str, out: torch.Tensor, inp: torch.Tensor, comm) -> None:
    if algorithm == "default":
        dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG)
    else:
        comm(output_tensor=out, input_tensor=inp, group=None, op=dist.ReduceOp.AVG)


def bench_sizes(sizes_mib: list[float], reps: int, block: int, link_gbps: float, device) -> list[dict]:
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for mib in sizes_mib:
        numel = int(mib * 2**20) // 4 // n * n
        g = torch.Generator().manual_seed(rank)
        inp = (torch.randn(numel, generator=g) * 1e-2).to(device)
        out = torch.empty(numel // n, device=device)
        comms = {
            "ring": sc.RingReduceScatter(),
            "int8": sc.QuantizedReduceScatter("int8", block, error_feedback=True),
            "fp8": sc.QuantizedReduceScatter("fp8", block, error_feedback=True),
        }
        times = {a: [] for a in ALGORITHMS}
        sent, wire = {}, {a: [] for a in ALGORITHMS}
        for rep in range(reps + 1):  # rep 0 warms up (allocations, kernel compilation)
            for a in ALGORITHMS:
                counters.reset()
                dist.barrier()
                _sync(device)
                tx0, t0 = nic_tx_bytes(), time.perf_counter()
                _run(a, out, inp, comms.get(a))
                _sync(device)
                dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
                if tx0 is not None:
                    # Read after every rank is done: a rank can finish receiving while its own
                    # sends still sit in its NIC queue. (The 8-byte all-reduce is noise.)
                    wire[a].append(nic_tx_bytes() - tx0)
                if rep:
                    times[a].append(float(dt))
                sent[a] = counters.bytes_sent() if a != "default" else sc.fp32_bytes_bound(numel, n)
        base = statistics.median(times["default"])
        for a in ALGORITHMS:
            med = statistics.median(times[a])
            rows.append(dict(
                size_mib=mib, algorithm=a, ms=1e3 * med, time_vs_default=med / base,
                bytes_per_rank=sent[a], bytes_vs_fp32=sent[a] / sc.fp32_bytes_bound(numel, n),
                bytes_measured=a != "default", link_ms=1e3 * sent[a] * 8 / (link_gbps * 1e9),
                nic_tx_bytes=statistics.median(wire[a]) if wire[a] else None,
            ))
    return rows


def _median_time(fn, reps: int, device) -> float:
    fn()
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _chain_quantize(x, block, kind, residual):
    """The textbook torch expression of quantise + error feedback (what the fused kernels
    replace): ~10 element-wise kernels, each allocating its output. Bucket sizes divide `block`."""
    rows, cols = x.shape
    c = x.float() + residual
    tiles = c.view(rows, -1, block)
    scale = tiles.abs().amax(dim=-1) / sc.quantization.QMAX[kind]
    y = tiles / torch.where(scale > 0, scale, 1.0)[..., None]
    codes = y.round().clamp(-127, 127).to(torch.int8) if kind == "int8" else y.clamp(-448, 448).to(torch.float8_e4m3fn)
    residual.copy_((tiles - codes.float() * scale[..., None]).view(rows, cols))
    return codes, scale


def _chain_dequantize_accumulate(codes, scale, block, divisor):
    rows = codes.shape[0]
    return sum(codes[r].float() * scale[r][:, None] for r in range(rows)).view(-1) / divisor


def bench_kernels(mib: float, block: int, reps: int, device) -> list[dict]:
    """Quantise(+error feedback) and dequantise-accumulate of one bucket: the unfused torch
    chain vs smp_collectives' torch path (in place, the CPU path) vs fused Triton (GPU)."""
    rows_n = 4
    x = torch.randn(rows_n, int(mib * 2**20) // 4 // rows_n // block * block, device=device)
    impls = ["chain", "torch"] + (["triton"] if device.type == "cuda" else [])
    out = []
    for kind in ("int8", "fp8"):
        for impl in impls:
            res = torch.zeros_like(x)
            if impl == "chain":
                codes, s = _chain_quantize(x, block, kind, res)
                t_q = _median_time(lambda: _chain_quantize(x, block, kind, res), reps, device)
                t_d = _median_time(lambda: _chain_dequantize_accumulate(codes, s, block, 4.0), reps, device)
            else:
                t_q = _median_time(lambda: sc.quantize(x, block, kind, res, impl=impl), reps, device)
                q, s = sc.quantize(x, block, kind, impl=impl)
                t_d = _median_time(lambda: sc.dequantize_accumulate(q, s, block, kind, 4.0, impl=impl), reps, device)
            gb = x.numel() * 4 / 1e9
            out.append(dict(kind=kind, impl=impl, size_mib=mib,
                            quantize_ef_gbps=gb / t_q, dequant_acc_gbps=gb / t_d,
                            quantize_ef_ms=1e3 * t_q, dequant_acc_ms=1e3 * t_d))
    return out


def train_curves(steps: int) -> dict[str, float]:
    import smp
    from smp.testing.distributed import local_rows, world_mean
    from smp.testing.models import build, loss_of, pattern_batch

    settings = {
        "fp32": {}, "int8": {"gradient_sync": "int8"}, "fp8": {"gradient_sync": "fp8"},
        "int8_no_error_feedback": {"gradient_sync": {"algorithm": "int8", "error_feedback": False}},
    }
    final = {}
    for name, config in settings.items():
        smp.init(config)
        torch.manual_seed(smp.state.config.random_seed)
        model = smp.transform(build("llama"))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(7)
        losses = []
        for _ in range(steps):
            loss = loss_of(model, local_rows(pattern_batch(g, 8, 16, 256)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(world_mean(loss))
        final[name] = statistics.mean(losses[-20:])
        smp.shutdown()
    return final


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=float, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--link-gbps", type=float, default=100.0)
    parser.add_argument("--kernel-mib", type=float, default=16, help="0 skips the kernel benchmark")
    parser.add_argument("--train-steps", type=int, default=0, help="> 0 adds the training comparison")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    emulated_mbit = rounds.emulated_link_mbit()
    if emulated_mbit:
        args.link_gbps = float(emulated_mbit) / 1e3
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    rows = bench_sizes(args.sizes_mib, args.reps, args.block, args.link_gbps, device)
    kernels = bench_kernels(args.kernel_mib, args.block, args.reps, device) if rank == 0 and args.kernel_mib else []
    dist.barrier()
    if args.train_steps:
        final = train_curves(args.train_steps)
        if rank == 0:
            print(f"training, tiny Llama, world {n}, {args.train_steps} AdamW steps, mean loss of the last 20:")
            for name, v in final.items():
                print(f"{name:>24}: {v:.4f} ({100 * (v / final['fp32'] - 1):+.2f}% vs fp32)")
            rounds.write_result(f"collectives_train_w{n}_{backend}",
                                dict(world_size=n, steps=args.train_steps, final_loss=final), link_suffix=False)
    if rank == 0 and rows:
        where = f"emulated nodes, {emulated_mbit} Mbit/s NICs" if emulated_mbit else f"link model {args.link_gbps} Gbit/s"
        print(f"reduce-scatter, world {n}, {backend}, block {args.block}, {where}")
        print(f"{'MiB':>5} {'algorithm':>9} {'ms':>9} {'x default':>9} {'bytes/rank':>11} {'x fp32':>7} {'link ms':>8} {'NIC tx':>11}")
        for r in rows:
            mark = "" if r["bytes_measured"] else "*"
            print(f"{r['size_mib']:>5g} {r['algorithm']:>9} {r['ms']:>9.2f} {r['time_vs_default']:>9.2f} "
                  f"{r['bytes_per_rank']:>10d}{mark:1} {r['bytes_vs_fp32']:>7.3f} {r['link_ms']:>8.2f} "
                  f"{rounds.nic_cell(r['nic_tx_bytes'], 11)}")
        print("* (N-1)/N x S: the process group's collective is not instrumented")
        if kernels:
            print(f"\nquantisation kernels on {device.type}, {args.kernel_mib:g} MiB fp32 input")
        for k in kernels:
            print(f"{k['kind']:>5} {k['impl']:>7}: quantize+EF {k['quantize_ef_gbps']:.2f} GB/s "
                  f"({k['quantize_ef_ms']:.1f} ms), dequant+acc {k['dequant_acc_gbps']:.2f} GB/s ({k['dequant_acc_ms']:.1f} ms)")
        rounds.write_result(f"collectives_w{n}_{backend}", dict(
            world_size=n, backend=backend, emulated_link_mbit=float(emulated_mbit) if emulated_mbit else None,
            block=args.block, link_gbps=args.link_gbps, reps=args.reps,
            cpu_threads=torch.get_num_threads(), torch=torch.__version__, reduce_scatter=rows, kernels=kernels,
        ))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
