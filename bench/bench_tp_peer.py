"""smp's tensor parallel vs transformers' own, on the same saved checkpoints.

    python bench/bench_tp_peer.py [--rounds 5] [--steps 12] [--families llama,qwen3,mixtral]

For each family a tiny config (Llama, Qwen3 with per-head q/k norms, Mixtral with 3-D experts)
is built once from a fixed seed and written with `save_pretrained` to a local folder; nothing is
downloaded. Both peers load that folder on world 2 at TP=2, with the model's own transformers
plan, and train it with SGD:
  smp           `from_pretrained(path)` then `smp.transform` under `tensor_parallel_degree: 2`
  transformers  `from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))`
                (transformers joins the gloo process group itself)
Reported per family and peer:
  (a) exactness: the largest |loss - one-process loss| and |gradient - one-process gradient|
      (every parameter, gathered whole) over the first 3 SGD steps (lr 0.1), against the same
      folder loaded in one process on the same global batch;
  (b) step time: forward + backward + SGD step + zero_grad (+ reading the loss), median over
      all rounds (the first 2 steps of a run are warmup, the 3 exactness steps are not timed);
      each (round, peer) is its own `torchrun` run and the peers take turns, the order swapped
      every round, so machine noise hits both alike;
  (c) parameter bytes per rank (local shards of the DTensors).

Writes bench/results/tp_peer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS = ("smp", "transformers")
FAMILIES = ("llama", "qwen3", "mixtral")
RESULT = Path(__file__).parent / "results" / "tp_peer.json"
EXACT_STEPS, WARMUP, LR, SEED = 3, 2, 0.1, 0


def model_config(family: str, hidden: int, layers: int, vocab: int):
    import transformers as T

    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                  max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "llama":
        return T.LlamaConfig(**common)
    if family == "qwen3":  # per-head q_norm / k_norm: `replicated_with_grad_allreduce` in its plan
        return T.Qwen3Config(**common, head_dim=hidden // 8)
    if family == "mixtral":  # 3-D experts: `moe_tp_experts` + packed_colwise / rowwise
        return T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(family)


def save(family: str, path: str, a: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(model_config(family, a.hidden, a.layers, a.vocab)).save_pretrained(path)


# ----------------------------------------------------------------------------------------------
# One run (under torchrun): one peer, one family; rank 0 writes its report to --out.


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def _load(peer: str, path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if peer == "transformers":
        from transformers.distributed import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(tp_size=2))
    import smp

    smp.init({"tensor_parallel_degree": 2})
    return smp.transform(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = _load(a.worker, a.path)
    reference = AutoModelForCausalLM.from_pretrained(a.path, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_params = dict(reference.named_parameters())
    g = torch.Generator().manual_seed(1)
    batches = torch.randint(0, a.vocab, (EXACT_STEPS + a.steps, a.batch, a.seq_len), generator=g)

    loss_diff = grad_diff = 0.0
    for step in range(EXACT_STEPS):  # TP at world 2: both ranks see the whole global batch
        ids = batches[step]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        loss_diff = max(loss_diff, abs(float(_full(loss)) - float(ref_loss)))
        grad_diff = max(grad_diff, max(float((_full(p.grad) - ref_params[n].grad).abs().max())
                                       for n, p in model.named_parameters()))
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)

    times = []
    for step in range(EXACT_STEPS, EXACT_STEPS + a.steps):
        ids = batches[step]
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(_full(loss.detach()))
        times.append(time.perf_counter() - t0)

    report = {"loss_diff": loss_diff, "grad_diff": grad_diff, "times": times[WARMUP:],
              "param_bytes_per_rank": _local_bytes(model), "param_bytes_one_process": _local_bytes(reference)}
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(report))
    if a.worker == "smp":
        import smp

        smp.shutdown()
    else:
        dist.barrier()  # before destroy: gloo aborts at exit otherwise, now and then
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The driver: save each family once, then rounds of one run per peer, the order swapped each round.


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="global batch (TP ranks share it)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per run (the first 2 are warmup)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)

    shape = ["--hidden", str(a.hidden), "--layers", str(a.layers), "--vocab", str(a.vocab),
             "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--steps", str(a.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    families = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            path = os.path.join(tmp, family)
            save(family, path, a)
            runs = {peer: [] for peer in PEERS}
            for r in range(a.rounds):
                for peer in (PEERS if r % 2 == 0 else PEERS[::-1]):
                    out = os.path.join(tmp, f"{family}-{peer}-{r}.json")
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           __file__, "--worker", peer, "--path", path, "--out", out, *shape]
                    run = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    if run.returncode:
                        sys.exit(f"{family} {peer} round {r} failed:\n{run.stderr[-3000:]}")
                    runs[peer].append(json.loads(Path(out).read_text()))
                    print(f"{family} round {r} {peer}: median {statistics.median(runs[peer][-1]['times']):.4f} s/step",
                          flush=True)
            families[family] = _summary(runs)
    import torch
    import transformers

    result = {
        "world_size": 2, "tensor_parallel_degree": 2, "rounds": a.rounds, "timed_steps_per_run": a.steps - WARMUP,
        "shape": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "heads": 8, "kv_heads": 4,
                  "seq_len": a.seq_len, "global_batch": a.batch},
        "exactness": f"max over the first {EXACT_STEPS} SGD steps (lr {LR}) vs one process, same folder and batch",
        "families": families,
        "device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "transformers": transformers.__version__, "load_average_1min_at_end": os.getloadavg()[0],
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _summary(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for peer, reports in runs.items():
        out[peer] = {
            "loss_diff": max(r["loss_diff"] for r in reports),
            "grad_diff": max(r["grad_diff"] for r in reports),
            "step_s_median": statistics.median(t for r in reports for t in r["times"]),
            "param_bytes_per_rank": reports[-1]["param_bytes_per_rank"],
            "param_bytes_one_process": reports[-1]["param_bytes_one_process"],
        }
    out["smp_over_transformers_step_time"] = out["smp"]["step_s_median"] / out["transformers"]["step_s_median"]
    return out


if __name__ == "__main__":
    main()
