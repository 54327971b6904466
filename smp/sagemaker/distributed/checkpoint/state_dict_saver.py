"""`torch.sagemaker.distributed.checkpoint.state_dict_saver`: save / async_save /
maybe_finalize_async_calls on torch.distributed.checkpoint.

Every rank that holds part of the state dict calls save (DCP deduplicates replicated tensors).
Before anything is written the ranks of the save agree on its path
(smp/checkpointing/commit/same_path.py): a script that saves per tensor-parallel rank into its own
folder passes the group that shares the folder (`process_group=model.process_group`), as SMP v2
scripts do; ranks of one group with different paths are refused on every rank.
An async save runs its collectives on a gloo group of its own (smp.checkpointing's, or a twin of
the `process_group` passed), so they never interleave with the training step's. It joins the
`queue` passed (an AsyncCallsQueue) or the session's default queue, which
`maybe_finalize_async_calls` finalizes and smp.shutdown finishes (smp/scope.py).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import SavePlanner, StorageWriter

import smp
from smp.checkpointing.commit.async_save import saves
from smp.checkpointing.commit.same_path import agree_on_path
from smp.sagemaker._guide import not_supported
from smp.sagemaker.distributed.checkpoint._options import check_smp_options
from smp.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
from smp.scope import Slot

log = logging.getLogger("smp.sagemaker")


def _finish(queue: AsyncCallsQueue) -> None:
    """At smp.shutdown: pending async saves finish while the process group still works."""
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:  # noqa: BLE001 - shutdown must finish; the failure is reported
        log.error("smp.sagemaker: a pending async_save failed: %s", e)


_CALLS: Slot[AsyncCallsQueue] = Slot("smp.sagemaker async_save calls", make=AsyncCallsQueue, close=_finish)
# Gloo twins of the subgroups async saves were given, by their ranks (see _async_group).
_TWINS: Slot[dict] = Slot("smp.sagemaker async_save groups", make=dict)


class PyTorchDistSaveShardedStrategy:
    """SMP v2's (Megatron's) sharded save strategy for `async_save(sharded_strategy=...)`. smp
    always writes with DCP, which is what this strategy chose: accepted, nothing to set."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, *args: Any, **kwargs: Any) -> None:
        self.backend, self.version = backend, version


def _agree(api: str, checkpoint_id: Any, storage: Any, process_group: dist.ProcessGroup | None) -> None:
    path = checkpoint_id if checkpoint_id is not None else getattr(storage, "path", None)
    if path is not None:
        agree_on_path(path, api, process_group)


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: str | None = None,
    s3client_config: Any = None,
) -> None:
    """Save `state_dict` (e.g. {"model": ..., "optimizer": ...} from
    torch.distributed.checkpoint.state_dict.get_state_dict) to `checkpoint_id`. Collective over
    `process_group` (default: all ranks). `wait_error_handling` and `force_check_all_plans`
    are what DCP always does."""
    check_smp_options("save", checkpoint_id, process_group, coordinator_rank, s3_region,
                      s3client_config, storage_writer is not None)
    maybe_finalize_async_calls(blocking=True, process_group=process_group)
    _agree("state_dict_saver.save", checkpoint_id, storage_writer, process_group)
    dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
             process_group=process_group, no_dist=not dist.is_initialized())


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int = 0,
    queue: Any = None,
    sharded_strategy: Any = None,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: str | None = None,
    s3client_config: Any = None,
) -> int:
    """`save` that returns once the state is copied to host memory; storage writes finish in
    the background. Returns the call's index in its queue (`queue`, an AsyncCallsQueue, or the
    default one that maybe_finalize_async_calls finalizes)."""
    if queue is not None and not isinstance(queue, AsyncCallsQueue):
        raise TypeError(f"async_save(queue=...) takes an AsyncCallsQueue, got {type(queue).__name__}")
    if sharded_strategy is not None and not isinstance(sharded_strategy, PyTorchDistSaveShardedStrategy):
        not_supported(f"async_save(sharded_strategy={type(sharded_strategy).__name__})", "checkpoints",
                      "smp writes with torch.distributed.checkpoint (PyTorchDistSaveShardedStrategy); "
                      "drop sharded_strategy")
    check_smp_options("async_save", checkpoint_id, process_group, coordinator_rank, s3_region,
                      s3client_config, storage_writer is not None)
    _agree("state_dict_saver.async_save", checkpoint_id, storage_writer, process_group)
    future = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                            planner=planner, process_group=_async_group(process_group),
                            no_dist=not dist.is_initialized())
    return (queue if queue is not None else _CALLS.get()).add(future)


def _async_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group for the save's background collectives: smp.checkpointing's for the world; for
    a subgroup a twin of its ranks, made by its members alone on first use."""
    if not dist.is_initialized():
        return None
    timeout = smp.state.config.collective_timeout_seconds if smp.is_initialized() else None
    if process_group is None or dist.get_world_size(process_group) == dist.get_world_size():
        return saves().group(timeout)
    ranks = tuple(dist.get_process_group_ranks(process_group))
    twins = _TWINS.get()
    if ranks not in twins:
        kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        twins[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True, **kwargs)
    return twins[ranks]


def maybe_finalize_async_calls(blocking: bool = True, process_group: dist.ProcessGroup | None = None) -> list[int]:
    """Finish the default queue's async saves: all of them (`blocking`), else those done on every
    rank of `process_group` (default: all ranks; call it on all of them). Returns their indices
    and re-raises a failed save's error."""
    return _CALLS.get().maybe_finalize_async_calls(blocking, process_group)
