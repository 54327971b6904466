"""This process as one rank of a world of any size, over torch's fake process group.

The fake backend (torch's FakeStore) accepts every collective and moves nothing, so FSDP2 and
tensor parallel can place a model for rank r of N with no peers and no memory (on meta).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from smp._compat import fake_store
from smp.config import ConfigError


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as `rank` of a world of `world_size`, over torch's fake process group."""
    if dist.is_initialized():
        raise RuntimeError(
            "smp plan needs a process without a process group (it joins a fake one of the planned "
            "size); run it from the command line (`smp plan`) or before smp.init"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside a world of {world_size}")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
