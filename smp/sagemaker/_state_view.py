"""`tsm.state`: smp's run state (`smp.state`) seen through SMP v2's names.

Every smp name (`rank`, `tp_rank`, `dp_rank`, `mesh`, `config`, ...) reads through to
`smp.state`; SMP v2's own names (`tensor_parallel_degree`, `rep_rank_process_group`, `ranker`,
...) are computed here from smp's mesh and config. The core state knows none of them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

import smp
from smp.runtime import is_initialized
from smp.sagemaker._guide import section
from smp.sagemaker.ranker import Ranker


def _cp_process_group(st: Any) -> dist.ProcessGroup | None:
    """SMP v2 gives None without context parallel (smp's "cp" axis then has size 1)."""
    return st.mesh["cp"].get_group() if st.cp_size > 1 else None


def _rep_rank_process_group(st: Any) -> dist.ProcessGroup:
    """The ranks with this rank's replication rank: its whole replica (every axis but
    dp_replicate). Under HSDP with more than one inner axis the first read creates the group, a
    collective: read it on every rank, as SMP v2 scripts do."""
    if st.dims.dp_replicate == 1:
        return dist.group.WORLD
    names = st.mesh.mesh_dim_names or ()
    inner = tuple(n for n in names if n != "dp_replicate" and st.mesh[n].size() > 1) or ("dp_shard",)
    if len(inner) == 1:
        return st.mesh[inner[0]].get_group()
    from smp._compat import flatten_mesh

    return flatten_mesh(st.mesh, inner, "_".join(inner)).get_group()


# SMP v2's names, each computed from smp's state; `cached` ones are computed once per run.
_NAMES: dict[str, Callable[[Any], Any]] = {
    "tensor_parallel_degree": lambda st: st.tp_size,
    "context_parallel_degree": lambda st: st.cp_size,
    "expert_parallel_degree": lambda st: st.ep_size,
    "hybrid_shard_degree": lambda st: st.config.hybrid_shard_degree,  # as configured (SMP v2: "a copy from user input")
    "sm_activation_offloading": lambda st: st.config.activation_offloading,
    "tp_process_group": lambda st: st.mesh["tp"].get_group(),
    "cp_process_group": _cp_process_group,
    "world_process_group": lambda st: dist.group.WORLD,
    "rep_rank_process_group": _rep_rank_process_group,
    "ranker": lambda st: Ranker(st.mesh),
}
_CACHED = {"rep_rank_process_group", "ranker"}


class StateView:
    """`smp.sagemaker.state`: read-only, like `smp.state`."""

    def __init__(self) -> None:
        object.__setattr__(self, "_cache", {})  # (id of the run's state, name) -> value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in _NAMES:
            return getattr(smp.state, name)
        if not is_initialized():
            raise RuntimeError(f"tsm.state.{name} is not available: call tsm.init(config) first")
        st = smp.runtime.current()
        key = (id(st), name)
        cache = object.__getattribute__(self, "_cache")
        if name not in _CACHED:
            return _NAMES[name](st)
        if key not in cache:
            if any(k[0] != id(st) for k in cache):
                cache.clear()  # another run's groups
            cache[key] = _NAMES[name](st)
        return cache[key]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"tsm.state is read-only: cannot set tsm.state.{name}. It reports the run that "
            f"tsm.init(config) set up; to change it, set the key in that config (e.g. "
            f"$SM_HP_MP_PARAMETERS) (see {section('state')})"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __repr__(self) -> str:
        return "tsm." + repr(smp.state)


state = StateView()
