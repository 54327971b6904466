"""Fine-tune a transformers causal LM with smp doing the parallelism.

With no arguments: a tiny Llama built from its config, trained for a few dozen steps on a
built-in corpus (English text that ships with Python's standard library), byte-level tokens,
on however many processes torchrun started:

    torchrun --standalone --nproc-per-node 2 examples/finetune_causal_lm.py
    torchrun --nproc-per-node 4 examples/finetune_causal_lm.py --config examples/configs/hybrid.yaml
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import smp
from smp.testing.models import tiny_llama_config


def builtin_corpus() -> str:
    """Documentation text every Python installation carries: no download needed."""
    import argparse as a, collections, csv, functools, inspect, json, logging, pathlib, re, subprocess, threading, unittest  # noqa: E401,E501

    modules = [a, collections, csv, functools, inspect, json, logging, pathlib, re, subprocess, threading, unittest]
    texts = []
    for module in modules:
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200 and doc not in texts:
                texts.append(doc)
    return "\n\n".join(texts)


def packed_sequences(text: str, seq_len: int) -> torch.Tensor:
    """Byte-level tokens, packed into fixed-length rows (no padding, no waste)."""
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    rows = ids.numel() // seq_len
    return ids[: rows * seq_len].view(rows, seq_len)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="smp config (YAML/JSON); default: built-in defaults")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all data-parallel ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    smp.init(args.config)
    st = smp.state
    if args.global_batch % st.dp_size:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the data-parallel size {st.dp_size}")
    local_batch = args.global_batch // st.dp_size

    from transformers import LlamaForCausalLM

    with smp.init_context():
        model = LlamaForCausalLM(tiny_llama_config(vocab_size=256, max_position_embeddings=args.seq_len))
    model = smp.transform(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    data = packed_sequences(builtin_corpus(), args.seq_len)
    generator = torch.Generator().manual_seed(st.config.random_seed)  # same order on every rank
    first_loss = last_loss = None
    start = time.perf_counter()
    for step in range(args.steps):
        rows = torch.randint(0, data.shape[0], (args.global_batch,), generator=generator)
        mine = rows[st.dp_rank * local_batch:(st.dp_rank + 1) * local_batch]
        batch = data[mine].to(st.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=max(1, args.steps // 10))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grad_norm = smp.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = smp.training.all_reduce_mean(loss)
        first_loss = mean_loss if first_loss is None else first_loss
        last_loss = mean_loss
        if st.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean_loss:.4f}  grad_norm {float(grad_norm):.3f}", flush=True)
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.global_batch * args.seq_len
    if st.rank == 0:
        print(
            f"done: {args.steps} steps, loss {first_loss:.3f} -> {last_loss:.3f}, "
            f"{tokens / elapsed:.0f} tokens/s on {st.world_size} ranks ({st.dims.describe()})"
        )
    smp.shutdown()


if __name__ == "__main__":
    main()
