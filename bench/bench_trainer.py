"""transformers Trainer on smp vs Trainer on accelerate's own FSDP2 plugin vs smp's own loop.

    python bench/bench_trainer.py [--world 2] [--rounds 5] [--model tiny] [--config '{}']

Three ways to train the same model (same init, shape, per-device batch, mesh of `world` ranks):
  smp_trainer    SMPTrainer(..., smp_config=config)
  fsdp2_trainer  Trainer(..., args=TrainingArguments(fsdp=True, fsdp_config={"version": 2,
                 "transformer_layer_cls_to_wrap": [decoder layer], "reshard_after_forward": True}))
  own_loop       smp.transform + a hand-written loop
All three use one optimizer implementation (torch AdamW, for-loop: foreach=False, fused=False;
the Trainer's default `adamw_torch_fused` would otherwise be compared with another kernel) and
clip at 1.0. Step = forward + backward + clip + optimizer step + zero_grad; a Trainer step is
timed by a callback from on_step_begin to on_step_end (logging and saving off).

Each (round, mode) is its own `torchrun` run, and the modes take turns round by round (the
order rotates each round), so machine noise hits all three alike and no process state
(accelerate's singleton AcceleratorState, smp's runtime) leaks from one mode into another.
Reported: the median step time of each mode over all rounds (first 2 steps of a run are warmup),
the ratios smp_trainer / fsdp2_trainer (goal <= 1.0) and smp_trainer / own_loop, and the
parameter + optimizer-state bytes per rank of each (goal: the same for smp and FSDP2).

Writes bench/results/trainer.json.
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

MODES = ("smp_trainer", "fsdp2_trainer", "own_loop")
RESULT = Path(__file__).parent / "results" / "trainer.json"


# ----------------------------------------------------------------------------------------------
# One run (under torchrun): one mode, `steps` steps, rank 0 writes its times and bytes to --out.


def _optimizer_kwargs(lr: float) -> dict:
    return {"lr": lr, "foreach": False, "fused": False}


def _state_bytes(model, optimizer) -> int:
    """Parameters + optimizer state held by this rank (local shards of DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += local(v).numel() * v.element_size()
    return total


def _run(mode: str, a: argparse.Namespace) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import smp
    from smp.integrations import SMPTrainer
    from smp.models import build_causal_lm, resolve_model_config

    config = json.loads(a.config)
    model_config = resolve_model_config(a.model, max_position_embeddings=max(128, a.seq_len))
    torch.manual_seed(0)
    model = build_causal_lm(model_config)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // config.get("tensor_parallel_degree", 1)
    rows = torch.randint(0, model_config.vocab_size, (a.batch * dp * a.steps, a.seq_len),
                         generator=torch.Generator().manual_seed(0))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return rows.shape[0]

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

    if mode == "own_loop":
        with smp.session(config):
            model = smp.transform(model)
            optimizer = torch.optim.AdamW(model.parameters(), **_optimizer_kwargs(1e-4))
            mine = rows[: a.batch * a.steps].view(a.steps, a.batch, a.seq_len)  # one rank's share is enough
            times = []
            for step in range(a.steps):
                batch = mine[step].to(smp.state.device)
                t0 = time.perf_counter()
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                smp.clip_grad_norm_(model, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                float(loss.detach())  # the Trainer syncs on the loss too (nan filter)
                times.append(time.perf_counter() - t0)
            return {"times": times[2:], "state_bytes": _state_bytes(model, optimizer)}

    timer = StepTimer()
    extra = {}
    if mode == "fsdp2_trainer":
        layer = type(model.model.layers[0]).__name__
        extra = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [layer],
                                                     "reshard_after_forward": True})
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.batch, learning_rate=1e-4,
            lr_scheduler_type="constant", max_grad_norm=1.0, logging_strategy="no", save_strategy="no",
            report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
            **extra,
        )
        common = dict(model=model, args=args, train_dataset=Rows(), callbacks=[timer],
                      optimizer_cls_and_kwargs=(torch.optim.AdamW, _optimizer_kwargs(1e-4)))
        if mode == "smp_trainer":
            trainer = SMPTrainer(**common, smp_config=config)
        else:  # TrainingArguments joined the process group already
            trainer = _fsdp2_trainer_class(Trainer)(**common)
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        result = {"times": timer.times[2:], "state_bytes": _state_bytes(trainer.model, optimizer)}
    if mode == "smp_trainer":
        smp.shutdown()
    return result


def _fsdp2_trainer_class(trainer_cls: type) -> type:
    """`trainer_cls` whose accelerator runs its FSDP plugin on CPU too. accelerate 1.15 turns the
    plugin on only for GPU-like distributed types: on MULTI_CPU it drops it without a word and
    wraps the model in DDP (every rank then holds the whole model). On CPU we set the two fields
    that AcceleratorState would have set on a GPU; prepare() then runs its own fully_shard path."""

    class FSDP2Trainer(trainer_cls):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            from accelerate import FullyShardedDataParallelPlugin
            from accelerate.utils import DistributedType

            state = self.accelerator.state
            if state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True
            assert self.accelerator.is_fsdp2, "accelerate did not enable its FSDP2 plugin"

    return FSDP2Trainer


def worker(a: argparse.Namespace) -> None:
    result = _run(a.worker, a)
    import torch.distributed as dist

    # By the torchrun rank, not the process group: a Trainer run may have torn its group down
    # by now, and two ranks writing one file interleave.
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The driver: rounds of one run per mode, the order rotating, then medians.


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per device")
    p.add_argument("--steps", type=int, default=12, help="steps per run (the first 2 are warmup)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--config", default="{}", help="smp config as JSON (the FSDP2 run is full_shard)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)

    passthrough = ["--model", a.model, "--seq-len", str(a.seq_len), "--batch", str(a.batch),
                   "--steps", str(a.steps), "--config", a.config]
    times = {m: [] for m in MODES}
    state_bytes = {}
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
            for mode in order:
                out = os.path.join(tmp, f"{mode}-{r}.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.world}",
                       __file__, "--worker", mode, "--out", out, *passthrough]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                run = json.loads(Path(out).read_text())
                times[mode] += run["times"]
                state_bytes[mode] = run["state_bytes"]
                print(f"round {r} {mode}: median {statistics.median(run['times']):.4f} s/step", flush=True)
    median = {m: statistics.median(t) for m, t in times.items()}
    import torch

    result = {
        "world_size": a.world, "model": a.model, "seq_len": a.seq_len, "per_device_batch": a.batch,
        "smp_config": json.loads(a.config), "rounds": a.rounds, "steps_timed_per_mode": len(times["own_loop"]),
        "optimizer": "torch.optim.AdamW(foreach=False, fused=False) in all three",
        "step_s_median": median,
        "smp_trainer_over_fsdp2_trainer": median["smp_trainer"] / median["fsdp2_trainer"],
        "smp_trainer_over_own_loop": median["smp_trainer"] / median["own_loop"],
        "param_and_optimizer_bytes_per_rank": state_bytes,
        "device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "load_average_1min_at_end": os.getloadavg()[0],
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
