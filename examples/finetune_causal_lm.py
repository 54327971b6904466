"""Fine-tune a transformers causal LM with smp doing the parallelism.

With no arguments it runs a real small job on CPU: a tiny Llama built from its config, trained
on a built-in corpus (English documentation that ships with Python itself: no download),
byte-level tokens packed into fixed-length rows, warmup + cosine learning rate, gradient
clipping, evaluation loss, a checkpoint every few steps, and a safetensors export at the end.

    torchrun --standalone --nproc-per-node 2 examples/finetune_causal_lm.py
    smp run -n 2 examples/finetune_causal_lm.py --resume                # continue from the last checkpoint
    smp run -n 4 examples/finetune_causal_lm.py --config examples/configs/hybrid.yaml
    smp run -n 2 examples/finetune_causal_lm.py --config examples/configs/pipeline.yaml   # 2 pipeline stages
    smp run -n 8 examples/finetune_causal_lm.py --model /path/to/hf_model --data train.jsonl \\
        --config examples/configs/llama8b_fsdp_tp.yaml --seq-len 2048 --global-batch 64

--model takes a named shape (tiny, llama-1b, llama-8b, llama-70b: random init) or a local folder
saved by `save_pretrained` (its weights are loaded shard by shard; its tokenizer is used when
the folder has one). --data takes a .txt file or a .jsonl file with a "text" field per line.

Outputs under --output-dir: metrics.jsonl (one line per step), tensorboard/ (when tensorboard
is installed), metrics.png (when matplotlib is installed), checkpoints/step_N, hf/ (the export).

The training step is `smp.step(model, batch)` and the evaluation `smp.evaluate(model, batch)`
whatever the config's layout (FSDP, tensor, context, expert or pipeline parallel): the script
has no branch per layout (docs/training-step.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import smp
from smp import metrics
from smp.config import ConfigError, load_config
from smp.mesh import ParallelDims
from smp.models import MODEL_SHAPES, build_causal_lm, resolve_model_config
from smp.planning import comm_bytes_per_step

# ----------------------------------------------------------------------------------------------
# Data


def builtin_corpus() -> str:
    """Documentation text every Python installation carries: no download needed."""
    import argparse as a, collections, csv, functools, inspect, json as j, logging, pathlib, re, subprocess, threading, unittest  # noqa: E401,E501

    modules = [a, collections, csv, functools, inspect, j, logging, pathlib, re, subprocess, threading, unittest]
    texts = []
    for module in modules:
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200 and doc not in texts:
                texts.append(doc)
    return "\n\n".join(texts)


def read_texts(path: str, text_field: str) -> list[str]:
    """Documents from a .txt file (one document) or a .jsonl file (one per line)."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"error: --data {path!r}: no such file (give a .txt or .jsonl file, or omit "
                         f"--data to use the built-in corpus)")
    if p.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: --data {path!r} line {n} is not JSON: {e}") from None
            if not isinstance(record, dict) or text_field not in record:
                raise SystemExit(f"error: --data {path!r} line {n} has no {text_field!r} field "
                                 f"(choose the field with --text-field)")
            docs.append(str(record[text_field]))
        return docs
    return [p.read_text(encoding="utf-8")]


class ByteTokenizer:
    """Bytes as tokens (ids 0-255): made locally, works for any text, needs no files."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_tokenizer(model_spec: str):
    """The model folder's own tokenizer when it ships one, else bytes."""
    folder = Path(model_spec)
    if folder.is_dir() and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return ByteTokenizer()


def packed_rows(docs: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Documents tokenized, joined (with EOS between them when the tokenizer has one) and packed
    into fixed-length rows: no padding, nothing wasted but the tail."""
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc))
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    rows = len(ids) // seq_len
    return torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def step_rows(step: int, n_rows: int, global_batch: int, seed: int) -> torch.Tensor:
    """The global batch's row indices at `step`: a function of (seed, step) only, so a resumed
    run draws exactly the batches the uninterrupted run would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_rows, (global_batch,), generator=g)


# ----------------------------------------------------------------------------------------------
# Schedule


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to `min_ratio` x peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------
# Arguments and early checks (before any process group exists, so errors are clean)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="smp config (YAML/JSON); default: $SMP_CONFIG or smp's defaults")
    p.add_argument("--model", default="tiny", help="named shape (tiny, llama-1b, llama-8b, llama-70b) or a local model folder")
    p.add_argument("--data", default=None, help=".txt or .jsonl file; default: the built-in corpus")
    p.add_argument("--text-field", default="text", help="the text field of each .jsonl line")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in total (a resumed run continues to it)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step over all data-parallel ranks")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping: max global norm")
    p.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=2, help="global batches of held-out rows per evaluation")
    p.add_argument("--output-dir", default="runs/finetune")
    p.add_argument("--checkpoint-every", type=int, default=20, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest checkpoint in --output-dir, or from the given checkpoint folder")
    p.add_argument("--no-export", dest="export", action="store_false", help="skip the safetensors export at the end")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="plain log lines instead of a bar")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "global_batch", "grad_accum"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    return args


def check_args(args: argparse.Namespace, world_size: int) -> ParallelDims:
    """Every user error we can see before starting: clear messages, on every rank alike."""
    try:
        dims = ParallelDims.from_config(load_config(args.config), world_size)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if args.model not in MODEL_SHAPES:
        folder = Path(args.model)
        if not folder.is_dir():
            raise SystemExit(f"error: --model {args.model!r} is neither a named shape ({', '.join(MODEL_SHAPES)}) "
                             f"nor a local folder")
        if not (folder / "config.json").exists():
            raise SystemExit(f"error: --model folder {args.model!r} has no config.json; give a folder written by "
                             f"save_pretrained (config.json + *.safetensors)")
    if args.data is not None and not Path(args.data).is_file():
        raise SystemExit(f"error: --data {args.data!r}: no such file (give a .txt or .jsonl file, or omit --data "
                         f"to use the built-in corpus)")
    if args.global_batch % dims.dp:
        raise SystemExit(
            f"error: --global-batch {args.global_batch} is not divisible by the data-parallel size {dims.dp} "
            f"({dims.describe()}); use a multiple of {dims.dp}"
        )
    local = args.global_batch // dims.dp
    if local % args.grad_accum:
        raise SystemExit(
            f"error: the per-rank batch {local} (--global-batch {args.global_batch} / data-parallel size {dims.dp}) "
            f"is not divisible by --grad-accum {args.grad_accum}"
        )
    return dims


# ----------------------------------------------------------------------------------------------
# Model


def build_model(args: argparse.Namespace, seq_len: int):
    if args.model in MODEL_SHAPES:
        config = resolve_model_config(args.model, max_position_embeddings=max(seq_len, 128))
    else:
        config = resolve_model_config(args.model)
    with smp.init_context():
        model = build_causal_lm(config)
    return model


def load_weights(model, folder: str, log) -> None:
    """Load a local Hugging Face folder's safetensors into the (already sharded) model."""
    if not list(Path(folder).glob("*.safetensors")):
        log(f"note: {folder!r} holds no *.safetensors weights; training from random initialisation")
        return
    smp.checkpointing.load_hf(folder, model)


# ----------------------------------------------------------------------------------------------
# Training


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, args, st) -> float:
    """Mean loss of the held-out global batches (each rank passes its data-parallel rows;
    smp.evaluate returns each global batch's loss on every rank)."""
    model.eval()
    per_rank = args.global_batch // st.dp_size
    batches = max(1, min(rows.shape[0] // args.global_batch, args.eval_batches))  # held out: >= 1 batch
    losses = []
    for start in range(0, batches * args.global_batch, args.global_batch):
        mine = rows[start + st.dp_rank * per_rank: start + (st.dp_rank + 1) * per_rank].to(st.device)
        losses.append(float(smp.evaluate(model, {"input_ids": mine})))
    model.train()
    return sum(losses) / len(losses)


def grad_sync_bytes(formula: dict[str, int], st) -> tuple[int, str]:
    """Gradient-sync bytes this rank sends per step: what smp_collectives counted for the parts
    it runs, plus the bandwidth-optimal count (`formula`, from comm_bytes_per_step, computed
    once) for the parts the process group's own collectives run."""
    measured = smp.gradient_sync_bytes(reset=True)["total"]
    sync = st.config.gradient_sync
    native = 0
    if sync.algorithm == "default":
        native += formula["reduce_scatter"]
    if sync.cross_replica == "default":
        native += formula["all_reduce_replicas"]
    source = "measured" if not native else ("formula" if not measured else "measured+formula")
    return measured + native, source


def main(argv=None) -> None:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world_size)

    smp.init(args.config)
    st = smp.state
    is_main = st.rank == 0
    log = print if is_main else (lambda *a, **k: None)
    out_dir = Path(args.output_dir)
    ckpt_root = out_dir / "checkpoints"

    # Data: tokenized and packed the same way on every rank; the tail rows are held out.
    tokenizer = load_tokenizer(args.model)
    docs = read_texts(args.data, args.text_field) if args.data else [builtin_corpus()]
    rows = packed_rows(docs, tokenizer, args.seq_len)
    n_eval = max(args.global_batch, rows.shape[0] // 20)
    if rows.shape[0] < n_eval + args.global_batch:
        raise SystemExit(f"error: the data gives only {rows.shape[0]} rows of {args.seq_len} tokens; need at least "
                         f"{n_eval + args.global_batch} (more text, a smaller --seq-len or --global-batch)")
    train_rows, eval_rows = rows[:-n_eval], rows[-n_eval:]

    model = build_model(args, args.seq_len)
    vocab = model.get_input_embeddings().num_embeddings
    if int(rows.max()) >= vocab:
        raise SystemExit(f"error: token id {int(rows.max())} is outside the model's vocabulary ({vocab})")
    flops = metrics.model_flops(model)
    n_params = sum(p.numel() for p in model.parameters())  # the whole model's (a pipeline rank holds a slice)
    model = smp.transform(model)
    if args.model not in MODEL_SHAPES:
        load_weights(model, args.model, log)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    start_step = 0
    earlier = None if args.resume else smp.checkpointing.latest(str(ckpt_root), run="any")
    if earlier is not None:  # a save would refuse to replace that run's checkpoints: say so before training
        raise SystemExit(f"error: {str(ckpt_root)!r} holds checkpoints of an earlier run (newest: {earlier}); "
                         "pass --resume to continue it, or --output-dir to start a new run elsewhere")
    if args.resume:
        path = smp.checkpointing.latest(str(ckpt_root)) if args.resume == "latest" else args.resume
        if path is None:
            raise SystemExit(f"error: --resume: no checkpoint under {str(ckpt_root)!r}")
        extra = smp.checkpointing.load(path, model, optimizer)
        start_step = int(extra["step"])
        log(f"resumed from {path} at step {start_step}")

    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    local_batch = args.global_batch // st.dp_size
    micro = local_batch // args.grad_accum
    tokens_per_step = args.global_batch * args.seq_len
    meter = metrics.ThroughputMeter(flops.per_token(args.seq_len), st.world_size,
                                    metrics.peak_flops(metrics.device_name(st.device)))
    log(f"smp: {st.dims.describe()}, {n_params:,} parameters, "
        f"{train_rows.shape[0]} training rows of {args.seq_len} tokens, steps {start_step}..{args.steps}", flush=True)
    writer = metrics.MetricsWriter(out_dir, enabled=is_main, append=start_step > 0)
    expert_meter = metrics.ExpertLoadMeter(model)  # tokens per expert per step (MoE models; else nothing)
    progress = metrics.Progress(args.steps, start_step, enabled=is_main and args.progress)

    first_loss = last_loss = None
    sync_formula = comm_bytes_per_step(model, st.config, st.dims)  # constant: computed once
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, args.steps, args.lr, warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch_rows = step_rows(step, train_rows.shape[0], args.global_batch, st.config.random_seed)
        mine = train_rows[batch_rows[st.dp_rank * local_batch:(st.dp_rank + 1) * local_batch]].to(st.device)
        loss_sum = torch.zeros((), device=st.device)  # on the device: no host sync per micro-step
        for m in range(args.grad_accum):
            # One step for every layout: this rank's rows in, the global batch's loss out (every
            # rank). Accumulating micro-steps skip the gradient sync; the last one syncs.
            chunk = {"input_ids": mine[m * micro:(m + 1) * micro]}
            loss_sum += smp.step(model, chunk, scale=1.0 / args.grad_accum, accumulate=m < args.grad_accum - 1)
        grad_norm = smp.clip_grad_norm_(model, args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = float(loss_sum) / args.grad_accum  # also waits for the step to finish
        seconds = time.perf_counter() - t0
        first_loss = mean_loss if first_loss is None else first_loss
        last_loss = mean_loss

        peaks = {f"{kind}_bytes_per_rank": [int(v) for v in metrics.gather_per_rank(value, st.device)]
                 for kind, value in metrics.peak_memory_bytes(st.device).items()}
        sync_bytes, sync_source = grad_sync_bytes(sync_formula, st)
        record = {"loss": mean_loss, "lr": lr, "grad_norm": float(grad_norm), "step_seconds": seconds,
                  **meter.step(tokens_per_step, seconds),
                  **peaks,
                  "grad_sync_bytes_per_rank": sync_bytes, "grad_sync_bytes_source": sync_source,
                  # Summed over every rank; the tp ranks of a group route the same tokens.
                  **expert_meter.record(torch.distributed.group.WORLD if st.world_size > 1 else None,
                                        copies=st.dims.tp)}
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 or done == args.steps:
            record["eval_loss"] = evaluate(model, eval_rows, args, st)
            progress.write(f"step {done}: eval loss {record['eval_loss']:.4f}")
        writer.write(done, record)
        progress.update(step, mean_loss, record["tokens_per_s"])
        if args.checkpoint_every and (done % args.checkpoint_every == 0 or done == args.steps):
            smp.checkpointing.save(ckpt_root / f"step_{done}", model, optimizer, extra={"step": done},
                                   keep_last=args.keep_last)
            progress.write(f"step {done}: checkpoint {ckpt_root / f'step_{done}'}")
    progress.close()
    writer.close()

    if args.export and start_step < args.steps:
        path = smp.checkpointing.export_hf(out_dir / "hf", model)
        log(f"exported safetensors to {path}")
    if is_main and os.path.exists(writer.path):
        png = metrics.plot(metrics.read_jsonl(writer.path), out_dir / "metrics.png")
        log(f"metrics: {writer.path}" + (f", plot: {png}" if png else " (install matplotlib for a plot)"))
    if first_loss is not None:
        log(f"done: steps {start_step}..{args.steps}, loss {first_loss:.3f} -> {last_loss:.3f} on "
            f"{st.world_size} ranks ({st.dims.describe()})")
    smp.shutdown()


if __name__ == "__main__":
    main()
    sys.exit(0)
