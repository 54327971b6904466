"""An SMP v2-style training script, ported to smp: the SMP v2 structure (tsm.init, transform,
DelayedParamIniter, clip_grad_norm_, async_save / load, tsm.state) with `torch.sagemaker`
replaced by `smp.sagemaker`. docs/migrating-from-smp-v2.md shows the diff from the SMP v2
original, line by line.

The SMP config comes from the environment, as on SageMaker ($SM_HP_MP_PARAMETERS holds the
estimator's mp_parameters as JSON; or $SMP_CONFIG names a config file). On CPU:

    SM_HP_MP_PARAMETERS='{"hybrid_shard_degree": 2, "sm_activation_offloading": false}' \\
        torchrun --nproc_per_node 4 examples/smp_v2_style/train.py --max_steps 4
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

import smp.sagemaker as tsm
from smp.sagemaker import transform
from smp.sagemaker.delayed_param import DelayedParamIniter
from smp.sagemaker.distributed.checkpoint.state_dict_loader import load
from smp.sagemaker.distributed.checkpoint.state_dict_saver import async_save, maybe_finalize_async_calls
from smp.sagemaker.grad_norm import clip_grad_norm_
from smp.sagemaker.logger import get_logger
from smp.sagemaker.utils import utils as tsm_utils

logger = get_logger()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--train_batch_size", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--max_context_width", type=int, default=16)
    parser.add_argument("--hidden_width", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--data_seed", type=int, default=7)
    parser.add_argument("--delayed_param", type=int, default=1)
    parser.add_argument("--checkpoint_dir", type=str, default=None)
    parser.add_argument("--checkpoint_freq", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    return parser.parse_args(argv)


def get_model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=args.hidden_width, intermediate_size=2 * args.hidden_width,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads // 2, vocab_size=args.vocab_size,
        max_position_embeddings=args.max_context_width, use_cache=False,
    )


def get_batch(args: argparse.Namespace, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's rows of step `step`'s global batch (the same on every run)."""
    generator = torch.Generator().manual_seed(args.data_seed * 100_003 + step)
    rows = args.train_batch_size * dp_size
    batch = torch.randint(0, args.vocab_size, (rows, args.max_context_width), generator=generator)
    return batch[dp_rank * args.train_batch_size:(dp_rank + 1) * args.train_batch_size]


def reduce_loss(loss: torch.Tensor) -> float:
    loss_detached = loss.detach().clone()
    dist.all_reduce(loss_detached)
    return loss_detached.item() / dist.get_world_size()


def save_checkpoint(model, optimizer, total_steps: int, checkpoint_dir: str) -> None:
    # 1. wait for the previous checkpoint to finish
    maybe_finalize_async_calls(blocking=True)
    # 2. the sharded state dict (FSDP2: DTensor shards, one kind of state dict)
    model_state, optim_state = get_state_dict(model, optimizer)
    state_dict = {"model": model_state, "optimizer": optim_state, "total_steps": total_steps}
    # 3. every rank saves its shards; DCP writes each replicated tensor once
    async_save(state_dict, checkpoint_id=os.path.join(checkpoint_dir, f"step_{total_steps}"))


def load_checkpoint(model, optimizer, checkpoint_id: str) -> int:
    model_state, optim_state = get_state_dict(model, optimizer)
    state_dict = {"model": model_state, "optimizer": optim_state, "total_steps": 0}
    load(state_dict, checkpoint_id=checkpoint_id)
    set_state_dict(model, optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optimizer"])
    return state_dict["total_steps"]


def train(args: argparse.Namespace) -> list[float]:
    """Train; return the loss of each step (averaged over ranks)."""
    tsm.init()  # the config comes from $SM_HP_MP_PARAMETERS / $SMP_CONFIG
    global_rank, world_size = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = global_rank, world_size
    if tsm.state.tensor_parallel_degree > 1:
        dp_rank //= tsm.state.tensor_parallel_degree
        dp_size //= tsm.state.tensor_parallel_degree

    model_config = get_model_config(args)
    with tsm_utils.timeit(True, "Model creation", global_rank):
        if args.delayed_param:
            with torch.device("meta"):
                model = LlamaForCausalLM(model_config)
        else:
            model = LlamaForCausalLM(model_config)
    delayed_param_initer = DelayedParamIniter(model) if args.delayed_param else None
    with (
        delayed_param_initer.validate_params_and_buffers_inited() if delayed_param_initer else nullcontext(),
        tsm_utils.timeit(True, "transform", global_rank),
    ):
        # Shards (FSDP2) and materialises the meta model: this replaces the FSDP(...) wrap.
        model = transform(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = 0
    if args.resume_from_checkpoint:
        total_steps = load_checkpoint(model, optimizer, args.resume_from_checkpoint)

    losses = []
    model.train()
    while total_steps < args.max_steps:
        input_ids = get_batch(args, total_steps, dp_rank, dp_size)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        grad_norm = clip_grad_norm_(model, args.grad_clip)
        optimizer.step()
        total_steps += 1
        losses.append(reduce_loss(loss))
        if global_rank == 0:
            logger.info("step %d loss %.6f grad_norm %.4f", total_steps, losses[-1], float(grad_norm))
        if args.checkpoint_freq and total_steps % args.checkpoint_freq == 0:
            save_checkpoint(model, optimizer, total_steps, args.checkpoint_dir)
    maybe_finalize_async_calls(blocking=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    losses = train(args)
    if dist.get_rank() == 0:
        print("losses:", " ".join(f"{x:.6f}" for x in losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
