"""Process-group teardown that finishes while the interpreter is fully alive.

A gloo process group runs its collectives on native worker threads (`pt_gloo_runloop`, plus one
`gloo_tcp_loop` per group) that live as long as the group's C++ object. `destroy_process_group`
only unregisters a group: the object, and its threads, stay alive while any Python object still
references it (FSDP modules, DeviceMesh caches, smp's async-save group). Those references used
to go during interpreter finalization, so every group's destructor, and the joins of its worker
threads, ran while CPython was tearing itself down (seen with gdb: all four groups of a 2-rank
run with an async save were destroyed inside `Py_FinalizeEx`). A worker that drops the last
reference to a tensor whose Python object it owns must take the GIL; once finalization has
begun, CPython ends such a thread with `pthread_exit`, whose unwinding through a C++ `noexcept`
frame calls `std::terminate`: "terminate called without an active exception" (SIGABRT), after a
run that succeeded. It is a race (the worker must be releasing a tensor just as finalization
starts), hence about 1 run in 40 on a loaded machine.

So smp lets no such thread reach finalization: at shutdown it barriers every group it built
(all ranks' last collectives done), destroys the process group, and collects garbage so that
the groups nothing references any more are destroyed now, their threads joined; at exit (an
atexit hook runs before finalization begins) it collects again, for the groups that only the
training script's garbage still held (a model local to a `main()` that has returned).
"""

from __future__ import annotations

import atexit
import gc
import glob
from typing import Iterable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smp._compat import drop_cached_groups

# Thread names (Linux `comm`) of gloo's native threads: a group's workers and its transport loop.
GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")


def barrier_each(groups: Iterable[dist.ProcessGroup]) -> None:
    """A barrier on each group, last created first, so that no rank leaves while a peer is
    still in a collective of any of them. Every rank must pass the same groups in the same
    order (those of its own coordinates on the same mesh)."""
    for group in reversed(list(groups)):
        dist.barrier(group=group)


def forget_mesh_groups(meshes: Iterable[DeviceMesh]) -> None:
    """Drop the process groups a DeviceMesh caches (torch 2.11+ keeps them in the root mesh, for
    torch.compile tracing), once they are destroyed: the mesh outlives shutdown in whatever
    still references it, and would keep them alive until finalization."""
    for mesh in meshes:
        drop_cached_groups(mesh)


def release_unreferenced_groups() -> None:
    """Destroy every process group that only garbage still references, now (gc.collect runs
    their destructors, which join their worker threads) rather than during finalization."""
    gc.collect()


def gloo_thread_count() -> int:
    """How many gloo native threads this process has (Linux; 0 where /proc is missing)."""
    count = 0
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                count += f.read().strip() in GLOO_THREAD_NAMES
        except OSError:  # the thread ended while we looked
            pass
    return count


def release_at_exit() -> None:
    """Call `release_unreferenced_groups` again at interpreter exit (registered once). atexit
    handlers run before CPython starts finalizing: a group freed there has its threads joined
    while they can still take the GIL."""
    atexit.unregister(release_unreferenced_groups)  # at most once, however many sessions
    atexit.register(release_unreferenced_groups)
