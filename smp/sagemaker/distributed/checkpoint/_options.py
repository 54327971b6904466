"""SMP's checkpoint keyword arguments that DCP has no counterpart for: accepted when they ask
for what DCP does anyway, refused (naming the fix) when they ask for something else."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from smp.sagemaker._guide import not_supported


def check_smp_options(
    api: str,
    checkpoint_id: Any,
    process_group: dist.ProcessGroup | None,
    coordinator_rank: int,
    s3_region: str | None,
    s3client_config: Any,
    has_storage: bool,
) -> None:
    if (s3_region is not None or s3client_config is not None
            or (not has_storage and str(os.fspath(checkpoint_id or "")).startswith("s3://"))):
        not_supported(
            f"{api} to S3", "checkpoints",
            "write to a filesystem path (e.g. /opt/ml/checkpoints, synced to S3 by SageMaker), or "
            "pass a storage_writer / storage_reader for S3 (e.g. s3torchconnector's DCP writer)",
        )
    if dist.is_initialized():
        coordinator = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        if coordinator_rank != coordinator:
            not_supported(
                f"{api}(coordinator_rank={coordinator_rank})", "checkpoints",
                f"DCP's coordinator is the lowest rank of the process group ({coordinator} here); "
                "drop coordinator_rank",
            )
