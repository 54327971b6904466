"""`smp.init` / `smp.shutdown` and `smp.state`: the process group, the mesh and the config.

smp rides on torch.distributed as torchrun sets it up (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT or a rendezvous); it never launches processes or opens connections itself.

What a run owns. `smp.init` opens a session and `smp.shutdown` closes it; everything a run
makes besides the config and the mesh (async-save jobs and their process group, the
context-parallel setup, the watchdog, patches of other libraries, the checkpoint run id)
belongs to that session, not to a module. A module declares a slot for its kind of object at
import (`smp.scope.Slot`: allocates and registers nothing) and reaches the object through it:

    _SAVES = Slot("async checkpoint saves", make=AsyncSaves, close=AsyncSaves.close)
    _SAVES.get()      # this session's, made on first use; .peek() / .set(obj) / .clear()

`shutdown` closes the session's objects (newest first, while the process group still works)
and forgets them: the next session starts with none, so two sessions in one process never see
each other's state. Outside a session (plain torch.distributed) objects belong to the
process's scope; `smp plan` runs the recipe in a scope of its own (`smp.scope.isolated`).
Importing smp therefore registers no hook and patches nothing (tests/core/test_session_state.py).
A patch of another library is scoped the same way or tighter: the MoE load-balancing loss is
replaced only while the transformed model's forward runs (expert_parallel/load_balancing.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smp import scope as _scope
from smp.config import ConfigError, ConfigSource, SMPConfig, load_config
from smp.compile import check_cuda_graphs
from smp.fp8 import check_fp8
from smp.mesh import ParallelDims, default_backend, device_type_for
from smp.reliability.guard import report_uncaught_errors
from smp.reliability.rendezvous import restart_safe_store
from smp.reliability.teardown import barrier_each, forget_mesh_groups, release_at_exit, release_unreferenced_groups
from smp.reliability.timeouts import apply_collective_timeout, rendezvous_timeout
from smp.seeding import seed_everything


@dataclass
class _State:
    config: SMPConfig
    dims: ParallelDims
    mesh: DeviceMesh
    dp_mesh: DeviceMesh  # the flattened ("dp_replicate", "dp_shard") axis
    device: torch.device
    backend: str
    rank: int
    world_size: int
    local_rank: int
    owns_process_group: bool  # smp created it, so smp destroys it
    scope: _scope.Scope  # what the session owns, closed by shutdown (see the module docstring)

    # Coordinates on the mesh, derived once (training loops read them every step).
    @cached_property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @cached_property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    # Context parallel: ranks of one cp group share dp_rank (the same batch rows) and hold
    # different chunks of each sequence; cp_rank says which chunks.
    @cached_property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @cached_property
    def dp_shard_rank(self) -> int:
        return self.mesh["dp_shard"].get_local_rank()

    @cached_property
    def dp_replicate_rank(self) -> int:
        return self.mesh["dp_replicate"].get_local_rank()

    # Expert parallel: ranks of one ep group hold different experts (the "ep" axis, inside dp_shard).
    @cached_property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank()

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    # Pipeline parallel: which stage(s) this rank holds (the "pp" axis, outermost; SMP v1 named
    # them smp.pp_rank() / smp.pp_size()). Ranks of one stage share pp_rank.
    @cached_property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def pp_size(self) -> int:
        return self.dims.pp


class _StateProxy:
    """`smp.state`: attribute access to the live state, with a clear error before `smp.init`."""

    def __getattr__(self, name: str) -> Any:
        if _STATE is None:
            raise RuntimeError(f"smp.state.{name} is not available: call smp.init(config) first")
        return getattr(_STATE, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"smp.state is read-only: cannot set smp.state.{name}. It reports the run that "
            f"smp.init(config) set up; to change it, set the key in that config "
            f"(docs/migrating-from-smp-v2.md#state)"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __repr__(self) -> str:
        if _STATE is None:
            return "smp.state(<not initialised>)"
        return (
            f"smp.state(rank={_STATE.rank}, {_STATE.dims.describe()}, device={_STATE.device}, "
            f"backend={_STATE.backend})"
        )


_STATE: _State | None = None
state = _StateProxy()


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        hook()


_HOOKS = _scope.Slot("shutdown hooks", make=list, close=_run_hooks)


def register_shutdown_hook(hook: Callable[[], None]) -> None:
    """Call `hook()` when the open session shuts down, before the process group goes (in
    registration order; once per function however often registered). It must not raise.
    Only for the open session: state a module keeps across calls belongs in a `Slot`."""
    if _STATE is None:
        raise RuntimeError("register_shutdown_hook: no smp session is open; call smp.init first")
    hooks = _HOOKS.get()
    if hook not in hooks:
        hooks.append(hook)


def shutdown_hooks() -> list[Callable[[], None]]:
    """The hooks the open session will call at shutdown (none outside a session)."""
    return list(_HOOKS.peek() or []) if _STATE is not None else []


def is_initialized() -> bool:
    return _STATE is not None


def current() -> _State:
    if _STATE is None:
        raise RuntimeError("smp is not initialised: call smp.init(config) before smp.transform")
    return _STATE


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init(config: ConfigSource = None, *, backend: str | None = None, integrations: Sequence[Any] = ()) -> _State:
    """Validate the config, join (or create) the process group and build the device mesh.

    Reads torchrun's environment. With no RANK/WORLD_SIZE set it runs as a world of one.
    Calling it again with the same config is a no-op; with a different one is an error.
    `integrations`: objects adapting a library the script uses (smp.init passes
    smp.integrations.accelerate when accelerate is imported), each with `check_world(world_size)`
    (before the process group: refuse a launch that library misread) and `start(world_size)`
    (after the session opened).
    """
    global _STATE
    cfg = load_config(config)  # all config errors surface here, before any collective
    if _STATE is not None:
        if _STATE.config == cfg:
            return _STATE
        raise ConfigError(
            "smp.init was already called with a different config; call smp.shutdown() first"
        )

    if dist.is_initialized():
        owns = False
        world_size, rank = dist.get_world_size(), dist.get_rank()
        chosen_backend = dist.get_backend()
        if chosen_backend not in ("nccl", "gloo"):  # e.g. "cpu:gloo,cuda:nccl"
            chosen_backend = "nccl" if "nccl" in chosen_backend and torch.cuda.is_available() else "gloo"
    else:
        owns = True
        _check_launch_environment()
        world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
        chosen_backend = backend or cfg.backend or default_backend()
    # Degree checks need only the world size: fail before touching the network.
    dims = ParallelDims.from_config(cfg, world_size)
    for integration in integrations:  # e.g. an Accelerator that decided "one process" is refused here
        integration.check_world(world_size)

    local_rank = _env_int("LOCAL_RANK", 0)
    if chosen_backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("backend 'nccl' needs CUDA devices; set backend: gloo to run on CPU")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    check_fp8(cfg.fp8.recipe if cfg.fp8 else None, device)  # float8 needs CUDA >= 8.9 (smp/fp8.py)
    check_cuda_graphs(cfg.compile.cuda_graphs, device)  # CUDA graphs need CUDA (smp/compile.py)

    if owns:
        if "MASTER_ADDR" not in os.environ and world_size == 1:
            # A world of one without torchrun: a private in-process store, no network.
            store = dist.HashStore()
            dist.init_process_group(
                chosen_backend, store=store, rank=0, world_size=1,
                timeout=datetime.timedelta(seconds=cfg.collective_timeout_seconds),
            )
        else:
            # Ranks may arrive minutes apart; the configured timeout is set once all are in.
            join_timeout = rendezvous_timeout(cfg.collective_timeout_seconds)
            # Under torchrun, a store namespaced per restart attempt (see smp/reliability/rendezvous.py).
            store = restart_safe_store(join_timeout)
            dist.init_process_group(
                chosen_backend,
                timeout=join_timeout,
                device_id=device if chosen_backend == "nccl" else None,
                **({"store": store, "rank": rank, "world_size": world_size} if store is not None else {}),
            )

    mesh, dp_mesh = dims.build_mesh(device_type_for(chosen_backend))
    # Mesh sub-groups get torch's default timeout (30 min gloo), not the config's: set it.
    apply_collective_timeout(cfg.collective_timeout_seconds, [mesh, dp_mesh], include_default=owns)
    _STATE = _State(
        config=cfg, dims=dims, mesh=mesh, dp_mesh=dp_mesh, device=device, backend=chosen_backend,
        rank=rank, world_size=world_size, local_rank=local_rank, owns_process_group=owns,
        scope=_scope.open_session(f"session (rank {rank})"),
    )
    try:
        seed_everything(cfg.random_seed)
        _agree_on_run_id()
        report_uncaught_errors()  # an error outside every step_guard is reported as one (guard.py)
        for integration in integrations:  # e.g. the script's Accelerator(s) run on smp until shutdown
            integration.start(world_size)
    except BaseException:
        shutdown()  # a refusal after the session opened leaves none behind (a later init would reuse it)
        raise
    return _STATE


def _check_launch_environment() -> None:
    """Refuse a launcher environment torch.distributed cannot join, naming the launcher's fix:
    MASTER_ADDR without RANK / WORLD_SIZE is `accelerate launch` starting one process (its CPU
    launcher starts several only through mpirun)."""
    if "MASTER_ADDR" not in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    missing = f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'}"
    by_accelerate = "ACCELERATE_USE_CPU" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ
    launcher = ("`accelerate launch` started this process alone (on CPU it starts several processes only "
                "through mpirun, --mpirun_hostfile)" if by_accelerate else "this process was not started by torchrun")
    raise ConfigError(
        f"MASTER_ADDR is set but {missing} not: {launcher}. Launch every process through torchrun: on CPU "
        f"`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N script.py` or `ACCELERATE_USE_CPU=1 accelerate launch "
        f"--multi_gpu --num_processes N script.py`, on GPUs the same without ACCELERATE_USE_CPU; for one process "
        f"unset MASTER_ADDR (docs/accelerate.md)"
    )


def _agree_on_run_id() -> None:
    """Every rank names the same checkpoint run (smp/checkpointing/commit/run.py); a difference is a
    ConfigError on every rank, and the session closes again."""
    from smp.checkpointing.commit import run  # here: smp.checkpointing reaches smp.runtime

    try:
        run.agree()
    except ConfigError:
        shutdown()
        raise


def shutdown() -> None:
    """Forget smp's state; destroy the process group if smp created it.

    Barriers come first (on each mesh group, then the world), so that no rank tears down while
    a peer is still in its last collective. Then the groups nothing references any more are
    destroyed at once, and again at exit, so that gloo's worker threads are joined before the
    interpreter finalizes: a worker still alive then can abort the process (see
    smp/reliability/teardown.py and docs/platform.md).
    """
    global _STATE
    if _STATE is None:
        return
    st, owns = _STATE, _STATE.owns_process_group
    # (only while the group lives: a script that destroyed it, as SMP v2 scripts do, ends here too)
    mesh_groups = _mesh_groups(st) if owns and dist.is_initialized() else []
    # The session's objects close first, newest first: a pending async save commits, the
    # watchdog (which polls the store about to go) stops, patches of other libraries revert.
    _scope.close_session(st.scope)
    _STATE = None
    if owns and dist.is_initialized():
        barrier_each(mesh_groups)
        dist.barrier()
        dist.destroy_process_group()
        forget_mesh_groups([st.mesh, st.dp_mesh])
        del st, mesh_groups
        release_unreferenced_groups()
        release_at_exit()


def _mesh_groups(st: _State) -> list[dist.ProcessGroup]:
    """This rank's groups of the mesh and of its flattened dp axis, in creation order, once each."""
    groups: dict[int, dist.ProcessGroup] = {}
    for mesh in (st.mesh, st.dp_mesh):
        for group in mesh.get_all_groups():
            groups.setdefault(id(group), group)
    return list(groups.values())


@contextlib.contextmanager
def session(config: ConfigSource = None, *, backend: str | None = None,
            integrations: Sequence[Any] = ()) -> Iterator[_State]:
    """`with smp.session(cfg) as st:` = `smp.init(cfg)` ... `smp.shutdown()`, even on error.

    For notebooks, tests and scripts that run several configurations in one process.
    """
    st = init(config, backend=backend, integrations=integrations)
    try:
        yield st
    finally:
        shutdown()
