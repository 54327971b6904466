"""torch's deprecated `save_state_dict` / `load_state_dict` called the SMP v2 way.

SMP v2 scripts pass `coordinator_rank=min(get_global_ranks(process_group))`, the global rank of
the group's lowest member: on the torch releases SMP v2 shipped with, DCP used coordinator_rank
as the global root of its gathers and scatters. torch 2.13 reads it as a rank inside
process_group (it looks up the global rank itself), so for a group that does not start at global
rank 0 (one tensor-parallel rank's data-parallel group: `model.process_group` under TP) the
script's number fails (past the group's size) or names another member.

During a `tsm.init` session both functions read a coordinator_rank that is the global rank of a
member of process_group as that member. Which member coordinates does not change what is read
or written (the coordinator gathers the plans and writes the metadata of the same checkpoint),
so the translation chooses nothing the result depends on; a coordinator_rank that names no
member's global rank goes to torch unchanged. The patch lives as long as the session, like
smp.sagemaker.fsdp1's.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_loader as loader
import torch.distributed.checkpoint.state_dict_saver as saver

_FUNCTIONS = ((dcp, "save_state_dict"), (dcp, "load_state_dict"),
              (saver, "save_state_dict"), (loader, "load_state_dict"))


def group_coordinator(process_group: dist.ProcessGroup | None, coordinator_rank: int) -> int:
    """`coordinator_rank` as torch 2.13 reads it: the member's rank inside `process_group` when
    the number is a member's global rank, else the number unchanged."""
    if process_group is None or not dist.is_initialized():
        return coordinator_rank
    members = dist.get_process_group_ranks(process_group)
    return members.index(coordinator_rank) if coordinator_rank in members else coordinator_rank


def _reading_global_coordinator(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    # torch marks both functions deprecated (a FutureWarning at the caller): say it at the
    # script's line, not at this wrapper's
    deprecation = getattr(original, "__deprecated__", None)
    function = getattr(original, "__wrapped__", original) if deprecation else original

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if deprecation:
            warnings.warn(deprecation, FutureWarning, stacklevel=2)
        bound = signature.bind(*args, **kwargs)
        if "coordinator_rank" in bound.arguments:
            bound.arguments["coordinator_rank"] = group_coordinator(
                bound.arguments.get("process_group"), bound.arguments["coordinator_rank"])
        return function(*bound.args, **bound.kwargs)

    return call


class CoordinatorPatch:
    """The four names above, reading SMP v2's coordinator_rank; `remove` puts torch's back."""

    def __init__(self) -> None:
        self._saved = [(module, name, getattr(module, name)) for module, name in _FUNCTIONS]
        for module, name, original in self._saved:
            setattr(module, name, _reading_global_coordinator(original))

    def remove(self) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)
