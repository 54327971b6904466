"""Ending, at interpreter exit, a run whose process group smp did not create (the Trainer's).

transformers' `TrainingArguments` has accelerate create the process group (its `PartialState`)
before `SMPTrainer` calls `smp.init`, so smp finds the group there and, not having created it,
never destroys it; neither the Trainer nor accelerate does either. The group, the mesh groups
(held by the model and by the root mesh, which DTensor's sharding cache keeps), and their gloo
worker threads then live into interpreter finalization, where a worker can abort the process
after a good run ("terminate called without an active exception", smp/reliability/teardown.py):
9 gloo threads per rank were alive at exit in a 2-rank Trainer run, 2 runs in 90 aborted.

`end_run_at_exit(mesh, dp_mesh)` registers an exit handler that ends such a run the way
`smp.shutdown` ends one smp created: `smp.shutdown()` if the script did not call it, a barrier on
each mesh group and the world (no rank leaves while a peer is in its last collective), destroy
the process group, drop the groups the meshes cache, collect the garbage that held the rest.
atexit handlers run before CPython starts finalizing, so every worker thread is joined while it
can still take the GIL. A process ending with an uncaught exception skips the barriers (its
peers may never reach them); a barrier that fails (a peer already gone) is logged, not raised.
"""

from __future__ import annotations

import atexit
import logging
import sys
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smp.reliability.teardown import barrier_each, forget_mesh_groups, release_unreferenced_groups

log = logging.getLogger("smp.reliability")


def end_run_at_exit(*meshes: DeviceMesh) -> None:
    """At interpreter exit, shut smp down and destroy the process group (whoever created it),
    releasing the groups `meshes` cache. Held weakly: registering keeps nothing alive. Safe to
    call more than once (each handler finds what an earlier one left)."""
    refs = [weakref.ref(m) for m in meshes]
    atexit.register(_end_run, refs)


def _dying_of_an_exception() -> bool:
    """True when the interpreter exits because of an uncaught exception (CPython records it in
    `sys.last_value` / `sys.last_exc` before atexit handlers run)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _end_run(refs: list[weakref.ref]) -> None:
    import smp  # here: smp imports this package

    meshes = [m for m in (r() for r in refs) if m is not None]
    try:
        if smp.is_initialized():
            smp.shutdown()  # commits a pending async save, stops the step guard's watchdog
        if dist.is_initialized():
            if not _dying_of_an_exception():
                try:
                    groups: dict[int, dist.ProcessGroup] = {}
                    for mesh in meshes:
                        for group in mesh.get_all_groups():
                            groups.setdefault(id(group), group)
                    barrier_each(groups.values())
                    del groups
                    dist.barrier()
                except Exception as e:  # noqa: BLE001 - a peer already gone: still release ours
                    log.warning("smp: barrier at exit failed (%s: %s); ending anyway", type(e).__name__, e)
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - an exit handler must not raise
        log.warning("smp: ending the run at exit failed: %s: %s", type(e).__name__, e)
    forget_mesh_groups(meshes)
    del meshes
    release_unreferenced_groups()
