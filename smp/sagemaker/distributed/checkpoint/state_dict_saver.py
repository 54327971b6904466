"""`torch.sagemaker.distributed.checkpoint.state_dict_saver`: save / async_save /
maybe_finalize_async_calls on torch.distributed.checkpoint.

Every rank that holds part of the state dict calls save (DCP deduplicates replicated tensors).
An async save runs its collectives on a gloo group of its own (smp.checkpointing's), so they
never interleave with the training step's; `maybe_finalize_async_calls` is SMP's queue of them,
which the session owns (smp/scope.py): smp.shutdown finishes what is still pending.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import SavePlanner, StorageWriter

import smp
from smp.checkpointing.async_save import saves
from smp.sagemaker._guide import not_supported
from smp.sagemaker.distributed.checkpoint._options import check_smp_options
from smp.scope import Slot

log = logging.getLogger("smp.sagemaker")


class _AsyncCalls:
    def __init__(self) -> None:
        self.pending: list[tuple[int, Future]] = []  # (call index, future) not yet finalized, oldest first
        self.next_index = 0

    def finish(self) -> None:
        """At smp.shutdown: pending async saves finish while the process group still works."""
        try:
            for _, future in self.pending:
                future.result()
        except Exception as e:  # noqa: BLE001 - shutdown must finish; the failure is reported
            log.error("smp.sagemaker: a pending async_save failed: %s", e)
        self.pending.clear()


_CALLS: Slot[_AsyncCalls] = Slot("smp.sagemaker async_save calls", make=_AsyncCalls, close=_AsyncCalls.finish)


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
    the background. Returns the call's index (what maybe_finalize_async_calls reports)."""
    if queue is not None or sharded_strategy is not None:
        not_supported("async_save(queue=..., sharded_strategy=...)", "checkpoints",
                      "smp keeps one queue of async saves on DCP; drop both arguments")
    check_smp_options("async_save", checkpoint_id, process_group, coordinator_rank, s3_region,
                      s3client_config, storage_writer is not None)
    if process_group is None and dist.is_initialized():
        timeout = smp.state.config.collective_timeout_seconds if smp.is_initialized() else None
        process_group = saves().group(timeout)
    future = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                            planner=planner, process_group=process_group,
                            no_dist=not dist.is_initialized())
    calls = _CALLS.get()
    index, calls.next_index = calls.next_index, calls.next_index + 1
    calls.pending.append((index, future))
    return index


def maybe_finalize_async_calls(blocking: bool = True, process_group: dist.ProcessGroup | None = None) -> list[int]:
    """Finish async saves: all of them (`blocking`), else those done on every rank of
    `process_group` (default: all ranks; call it on all of them). Returns their indices and
    re-raises a failed save's error."""
    pending = _CALLS.get().pending
    count = len(pending)
    if not blocking:
        count = next((i for i, (_, f) in enumerate(pending) if not f.done()), len(pending))
        if dist.is_initialized():  # finalize only what every rank finished: the same calls everywhere
            agreed = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(agreed, count, group=process_group)
            count = min(agreed)
    finished, pending[:] = pending[:count], pending[count:]
    for _, future in finished:
        future.result()
    return [index for index, _ in finished]
