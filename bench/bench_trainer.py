"""transformers Trainer on smp (smp.integrations.SMPTrainer) vs smp's own training loop.

    torchrun --standalone --nproc-per-node 2 bench/bench_trainer.py [--model tiny] [--rounds 5]

Same model shape and init, same smp config (mesh), same per-device batch, AdamW, clipping at
1.0. Step = forward + backward + clip + optimizer step (+ zero_grad). The Trainer's step is
timed by a callback from on_step_begin to on_step_end (its logging and saving are off); the own
loop times the same work. The two take turns, round by round, so machine noise hits both;
reported: median step time of each and their ratio (goal <= 1.05).

Not measured here: Trainer with accelerate's own FSDP2 plugin (the goal ratio <= 1.0 of the
brief); see docs/trainer.md.

Writes bench/results/trainer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments

import smp
from smp.integrations import SMPTrainer
from smp.models import build_causal_lm, resolve_model_config


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.rows = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t0 = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


def own_loop(model, batches, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps):
        batch = batches[step % len(batches)].to(smp.state.device)
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        smp.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # the Trainer syncs on the loss too (nan filter)
        times.append(time.perf_counter() - t0)
    return times


def trainer_loop(model, dataset, batch: int, steps: int, config: dict, out: str) -> list[float]:
    timer = StepTimer()
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4,
        lr_scheduler_type="constant", max_grad_norm=1.0, logging_strategy="no", save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
    )
    trainer = SMPTrainer(model=model, args=args, train_dataset=dataset, smp_config=config, callbacks=[timer])
    trainer.train()
    return timer.times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per device")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (the first 2 are warmup)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--config", default="{}", help="smp config as JSON")
    a = p.parse_args()
    config = json.loads(a.config)

    dist.init_process_group("gloo")  # ours, so that smp.shutdown between rounds keeps it
    smp.init(config)
    torch.manual_seed(0)
    model_config = resolve_model_config(a.model, max_position_embeddings=max(128, a.seq_len))
    own_model = smp.transform(build_causal_lm(model_config))
    torch.manual_seed(0)
    trainer_model = build_causal_lm(model_config)  # SMPTrainer transforms it
    dataset = Rows(a.batch * smp.state.dp_size * (a.steps + 1), a.seq_len, model_config.vocab_size)
    mine = [dataset.rows[i * a.batch:(i + 1) * a.batch] for i in range(a.steps)]  # one rank's share is enough

    own, hf = [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(a.rounds):
            own += own_loop(own_model, mine, a.steps)[2:]
            hf += trainer_loop(trainer_model, dataset, a.batch, a.steps, config, out)[2:]
    result = {
        "world_size": smp.state.world_size, "mesh": smp.state.dims.describe(), "model": a.model,
        "seq_len": a.seq_len, "per_device_batch": a.batch, "steps_timed": len(own), "smp_config": config,
        "own_loop_step_s_median": statistics.median(own), "trainer_step_s_median": statistics.median(hf),
        "trainer_over_own_loop": statistics.median(hf) / statistics.median(own),
        "device": str(smp.state.device), "torch": torch.__version__,
    }
    if smp.state.rank == 0:
        path = Path(__file__).parent / "results" / "trainer.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    smp.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
