"""A training script written the SMP v2 way, run on smp: every SMP v2 pattern of AWS's SMP v2
example script (written anew for smp's tests, not copied): the config from
$SM_HP_MP_PARAMETERS, `tsm.state` names and SMP v2's data-parallel rank arithmetic, a meta
model with `DelayedParamIniter`, the script's own context-parallel batch cut, `offload_wrapper`
when `tsm.state.sm_activation_offloading`, `FSDP.state_dict_type` + `FSDP.optim_state_dict`
sharded state dicts saved into per-TP-rank folders with `process_group=model.process_group` and
`coordinator_rank` = the group's lowest global rank, either by torch's deprecated
`save_state_dict` (the `sharded` type) or by `async_save` through an `AsyncCallsQueue` (the
`async_sharded` type), checkpoint rotation with `torch.sagemaker.checkpoint.utils`, loading the
model with the matching loader and the optimizer with torch's
`load_sharded_optimizer_state_dict` + `FSDP.optim_state_dict_to_load` (or together with the
model), and a final `FULL_STATE_DICT` save that `from_pretrained` loads.

The one line that makes it an smp script is the first import (torch.sagemaker -> smp.sagemaker).
tests/integrations/test_smp_v2_script.py runs it at world 1, 2, 4 (TP 2 x dp 2, TP 2 x cp 2) and 8
(TP 2 x cp 2 x dp 2).
"""

from __future__ import annotations

import smp.sagemaker.as_torch_sagemaker  # noqa: F401  - the port: torch.sagemaker is smp.sagemaker

import argparse
import os

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
import torch.sagemaker.checkpoint.utils as tsm_checkpoint
from accelerate import init_empty_weights
from torch.distributed import checkpoint
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.api import FullStateDictConfig
from torch.sagemaker import transform
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save
from torch.sagemaker.grad_norm import clip_grad_norm_
from torch.sagemaker.utils.process_group_utils import get_global_ranks
from transformers import LlamaConfig, LlamaForCausalLM

CHECKPOINT_REGEX = r"^.*\d+steps$"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--global_batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--checkpoint_freq", type=int, default=10)
    p.add_argument("--num_kept_checkpoints", type=int, default=1)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--checkpoint_type", default="sharded", choices=["sharded", "async_sharded"])
    p.add_argument("--optimizer_loader", default="sharded_optimizer",
                   choices=["sharded_optimizer", "with_model", "none"],
                   help="sharded_optimizer: torch's load_sharded_optimizer_state_dict (SMP v2 scripts); "
                        "with_model: in the model's load; none: the test's negative control (the "
                        "optimizer starts empty)")
    p.add_argument("--model_dir", default=None)
    return p.parse_args(argv)


def model_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False)


def cut_for_cp_rank(t: torch.Tensor) -> torch.Tensor:
    """The SMP v2 scripts' own context-parallel cut: 2 x cp chunks, rank i keeps i and 2cp-1-i."""
    cp, r = tsm.state.cp_size, tsm.state.cp_rank
    if cp == 1:
        return t
    chunks = t.view(t.shape[0], 2 * cp, t.shape[1] // (2 * cp))
    return chunks.index_select(1, torch.tensor([r, 2 * cp - 1 - r])).reshape(t.shape[0], -1)


def batch(args, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    rows = torch.randint(0, 256, (args.global_batch, args.seq), generator=torch.Generator().manual_seed(1000 + step))
    per = args.global_batch // dp_size
    return rows[dp_rank * per:(dp_rank + 1) * per]


def train(args) -> dict:
    tsm.init()  # the config: $SM_HP_MP_PARAMETERS
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = rank // (tsm.state.tensor_parallel_degree * tsm.state.context_parallel_degree)
    dp_size = world // (tsm.state.tensor_parallel_degree * tsm.state.context_parallel_degree)

    with init_empty_weights():
        model = LlamaForCausalLM(model_config())
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = transform(model)
    if tsm.state.sm_activation_offloading:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

        model = offload_wrapper(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    process_group = model.process_group
    coordinator = min(get_global_ranks(process_group))
    action_rank = tsm.state.ranker.get_rep_rank(rank) == 0
    queue = AsyncCallsQueue()

    def folder(root: str) -> str:  # SMP v2 scripts: one folder per TP rank
        tp = tsm.state.tensor_parallel_degree
        return os.path.join(root, f"tp{tp}-{tsm.state.tp_rank}") if tp > 1 else root

    sharded = args.checkpoint_type == "sharded"
    start = 0
    if args.resume_from_checkpoint:
        resume_dir = folder(args.resume_from_checkpoint)
        reader = checkpoint.FileSystemReader if sharded else DistributedFileSystemReader
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "total_steps": 0}
            if args.optimizer_loader == "with_model":
                state["optimizer"] = FSDP.optim_state_dict(model, optimizer)
            (checkpoint.load_state_dict if sharded else load)(
                state_dict=state, storage_reader=reader(resume_dir), process_group=process_group,
                coordinator_rank=coordinator)
            model.load_state_dict(state["model"])
            if args.optimizer_loader == "sharded_optimizer":
                state["optimizer"] = load_sharded_optimizer_state_dict(
                    model_state_dict=state["model"], optimizer_key="optimizer",
                    storage_reader=reader(resume_dir))["optimizer"]
            if args.optimizer_loader != "none":
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                    model=model, optim=optimizer, optim_state_dict=state["optimizer"]))
        start = state["total_steps"]

    losses, offloaded = [], 0
    for step in range(start, args.max_steps):
        ids = cut_for_cp_rank(batch(args, step, dp_rank, dp_size))
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
        loss.backward()
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if step == start:
            from smp.activations.offloading import offload_stats  # the check's own view, not SMP v2's

            stats = offload_stats(model)
            offloaded = stats.total_offloaded_bytes if stats else 0
        if args.checkpoint_dir and (step + 1) % args.checkpoint_freq == 0:
            queue.maybe_finalize_async_calls(blocking=True, process_group=process_group)
            save_dir = folder(os.path.join(args.checkpoint_dir, f"llama-{step + 1}steps"))
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optimizer),
                         "total_steps": step + 1}
            if action_rank and sharded:
                checkpoint.save_state_dict(state_dict=state, storage_writer=checkpoint.FileSystemWriter(save_dir),
                                           planner=checkpoint.DefaultSavePlanner(), process_group=process_group,
                                           coordinator_rank=coordinator)
            elif action_rank:
                async_save(state, checkpoint_id=save_dir, process_group=process_group,
                           coordinator_rank=coordinator, queue=queue)
            queue.maybe_finalize_async_calls(blocking=True, process_group=process_group)
            dist.barrier()
            tsm_checkpoint.limit_num_subdirs(os.path.abspath(save_dir), args.num_kept_checkpoints,
                                             sort_fn=tsm_checkpoint.SORT_BY_LAST_INT, regex=CHECKPOINT_REGEX,
                                             log=rank == 0)
    queue.maybe_finalize_async_calls(blocking=True, process_group=process_group)
    if args.model_dir:  # the final full model, for inference
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
            full = model.state_dict()
            if rank == 0:
                os.makedirs(args.model_dir, exist_ok=True)
                torch.save(full, os.path.join(args.model_dir, "pytorch_model.bin"))
                model_config().save_pretrained(args.model_dir)
        dist.barrier()
    return {"losses": losses, "offloaded_bytes": offloaded}


def main(argv: list[str] | None = None) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        return train(parse_args(argv))
    finally:
        import smp

        smp.shutdown()


if __name__ == "__main__":
    print(main())
