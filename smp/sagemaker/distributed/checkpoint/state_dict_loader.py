"""`torch.sagemaker.distributed.checkpoint.state_dict_loader.load` on torch.distributed.checkpoint."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import LoadPlanner, StorageReader

from smp.checkpointing.commit.same_path import agree_on_path
from smp.sagemaker.distributed.checkpoint._options import check_smp_options
from smp.sagemaker.distributed.checkpoint.state_dict_saver import maybe_finalize_async_calls


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    check_keys_matched: bool = True,
    coordinator_rank: int = 0,
    s3_region: str | None = None,
    s3client_config: Any = None,
) -> None:
    """Fill `state_dict` in place from `checkpoint_id` (DCP reshards: any world size and
    degrees). Then hand it to set_state_dict / set_model_state_dict. DCP's planner always
    checks that every requested key exists (`check_keys_matched`)."""
    check_smp_options("load", checkpoint_id, process_group, coordinator_rank, s3_region,
                      s3client_config, storage_reader is not None)
    maybe_finalize_async_calls(blocking=True, process_group=process_group)  # never read a half-written save
    path = checkpoint_id if checkpoint_id is not None else getattr(storage_reader, "path", None)
    if path is not None:  # the ranks of the load read one checkpoint, as they wrote it
        agree_on_path(path, "state_dict_loader.load", process_group)
    dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader, planner=planner,
             process_group=process_group, no_dist=not dist.is_initialized())
