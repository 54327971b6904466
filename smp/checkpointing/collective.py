"""Small collectives every checkpoint step uses, under any torch.distributed process group (or
none): this rank, the world, a filesystem step run on rank 0, and agreement on a problem.

Each one doubles as a barrier and raises on every rank together, so that no rank is left
waiting in a collective when another one failed.
"""

from __future__ import annotations

import torch.distributed as dist

from smp.errors import CheckpointError


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world() -> int:
    return dist.get_world_size() if is_dist() else 1


def on_rank0(fn, what: str) -> None:
    """Run a filesystem step on rank 0; every rank returns after it, or raises its error.

    Doubles as the barrier: no rank is left waiting in a collective when rank 0 fails.
    """
    error = None
    if rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
    if is_dist():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(f"{what} failed on rank 0: {error}")


def agree(problem: str | None, what: str) -> None:
    """Collective: raise CheckpointError on every rank when any rank found a problem."""
    problems = [problem]
    if is_dist():
        problems = [None] * world()
        dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if found:
        raise CheckpointError(what + ":\n  " + "\n  ".join(dict.fromkeys(found)))
