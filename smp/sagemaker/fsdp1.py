"""FSDP1's calls that SMP v2 scripts make on the model, answered for a model that
`smp.sagemaker.transform` sharded (FSDP2), as SMP v2 answered them:

- `FSDP.state_dict_type(model, FULL_STATE_DICT, FullStateDictConfig(rank0_only=True, ...))`:
  inside it `model.state_dict()` is the full (unsharded) state dict, on rank 0 only with
  rank0_only, which `torch.save` + `from_pretrained` load; with SHARDED_STATE_DICT it is the
  DTensor-sharded one (FSDP2's own); LOCAL_STATE_DICT is refused. Under tensor parallelism the
  sharded one holds each TP rank's slice as a whole tensor over `model.process_group`, as SMP v2's
  did (smp/sagemaker/tp_slices.py), so per-TP-rank folders save and load through DCP over that
  group; `model.load_state_dict` inside the block takes such slices back.
- `FSDP.optim_state_dict(model, optimizer)`: the optimizer state dict of that kind;
  `FSDP.optim_state_dict_to_load(model, optimizer, osd)` loads it into the optimizer and returns
  the optimizer's state dict (so the script's `optimizer.load_state_dict(...)` changes nothing);
  it also takes what torch's `load_sharded_optimizer_state_dict` returns (FSDP1 ShardedTensors,
  made whole: exact under data parallelism; under TP each TP rank's slices, read over
  `model.process_group` from its per-TP-rank folder; refused under EP / PP).
- `FullyShardedDataParallel(model, ...)` of such a model raises MigrationError (delete the wrap).
- `offload_wrapper(model)` returns the model: smp's transform already offloads its activations
  (SMP v2 too answered this call with its own offloading).
- `model.process_group` (the ranks that shard this model's parameters together: one replica,
  one tensor- and expert-parallel rank) and `model.rank` (this rank in it) are set by transform.

Any other module goes to FSDP1 (and torch's offload_wrapper) unchanged. The patch of FSDP1's class is installed by
`smp.sagemaker.init` and removed when that session shuts down: a script that never imports
smp.sagemaker, or runs after the session, sees FSDP1 as torch ships it. So is the one of
`load_sharded_optimizer_state_dict`'s group (through smp._compat): torch finds the group to
chunk the optimizer state over only in FSDP1's 2-D layout; for per-TP-rank slices the session
answers `model.process_group`, the ranks that read one per-TP-rank folder, and the state is cut
over it (else torch cuts each tensor over the whole world and each rank reads its chunk from its
own TP rank's folder, so parts of every slice would be read by no rank).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, StateDictType
from torch.distributed.tensor import DTensor

from smp._compat import checkpoint_wrapper_module, patch_optimizer_loader_group, sharded_tensor_type
from smp.sagemaker._guide import MigrationError, not_supported, section
from smp.sagemaker.tp_slices import from_slice, local_part, slice_shape, state_to_slices, to_slice

_VIEW = "_smp_fsdp1_view"  # the attribute transform sets on the models this module answers for


@dataclass
class Fsdp1View:
    """What FSDP1 kept on a wrapped model, for a model smp sharded."""

    process_group: dist.ProcessGroup | None
    shard_mesh: Any = None  # the 1-D DeviceMesh of process_group (per-TP-rank slices live on it)
    full: bool = False  # inside state_dict_type(FULL_STATE_DICT)
    rank0_only: bool = False
    offload_to_cpu: bool = False
    depth: list = field(default_factory=list)  # enclosing state_dict_type settings


def adopt(model: nn.Module, process_group: dist.ProcessGroup | None, shard_mesh: Any = None) -> None:
    """Mark `model` (sharded by smp.sagemaker.transform) as answered here; set FSDP1's
    `process_group` and `rank` attributes (`shard_mesh`: that group's 1-D DeviceMesh)."""
    setattr(model, _VIEW, Fsdp1View(process_group=process_group, shard_mesh=shard_mesh))
    model.process_group = process_group
    model.rank = dist.get_rank(process_group) if dist.is_initialized() else 0


def shard_mesh(st: Any) -> Any:
    """The mesh axis of FSDP1's `process_group`: the ranks that shard the parameters together (one
    replica, one tensor-parallel rank); with context parallel FSDP shards over dp_shard x cp."""
    return st.mesh["dp_shard_cp" if st.cp_size > 1 else "dp_shard"]


def _view(module: Any) -> Fsdp1View | None:
    return getattr(module, _VIEW, None) if isinstance(module, nn.Module) else None


# --- the replacements (each falls through to FSDP1 for a module smp did not shard) -------------

def _state_dict_type(original: Any, module: nn.Module, state_dict_type: StateDictType,
                     state_dict_config: Any = None, optim_state_dict_config: Any = None) -> Iterator[Any]:
    view = _view(module)
    if view is None:
        with original(module, state_dict_type, state_dict_config, optim_state_dict_config) as settings:
            yield settings
        return
    if state_dict_type == StateDictType.LOCAL_STATE_DICT:
        not_supported(
            "FSDP.state_dict_type(model, LOCAL_STATE_DICT)", "checkpoints",
            "FSDP2 has one local form, the sharded (DTensor) state dict: use SHARDED_STATE_DICT",
        )
    full = state_dict_type == StateDictType.FULL_STATE_DICT
    view.depth.append((view.full, view.rank0_only, view.offload_to_cpu))
    view.full = full
    view.rank0_only = bool(getattr(state_dict_config, "rank0_only", False)) and full
    view.offload_to_cpu = bool(getattr(state_dict_config, "offload_to_cpu", False)) and full
    _install(module, view)
    try:
        yield None
    finally:
        view.full, view.rank0_only, view.offload_to_cpu = view.depth.pop()
        _install(module, view)


def _install(module: nn.Module, view: Fsdp1View) -> None:
    """This instance's `state_dict` / `load_state_dict` for the innermost state_dict_type block
    (the class's own outside every block, and for a sharded one without tensor parallelism)."""
    module.__dict__.pop("state_dict", None)
    module.__dict__.pop("load_state_dict", None)
    if not view.depth:
        return
    if view.full:
        module.state_dict = functools.partial(_full_state_dict, module, view)
    elif _per_tp_rank(view):
        module.state_dict = functools.partial(_sliced_state_dict, module, view)
        module.load_state_dict = functools.partial(_load_sliced_state_dict, module)


def _per_tp_rank(view: Fsdp1View) -> bool:
    """Whether this run's sharded state dicts hold per-TP-rank slices (tensor parallelism on)."""
    import smp

    return view.shard_mesh is not None and smp.is_initialized() and smp.state.tp_size > 1


def _sliced_state_dict(model: nn.Module, view: Fsdp1View, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """SMP v2's sharded state dict under TP: each DTensor as this TP rank's slice."""
    return state_to_slices(type(model).state_dict(model, *args, **kwargs), view.shard_mesh)


def _load_sliced_state_dict(model: nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
    """`model.load_state_dict` of a state dict holding per-TP-rank slices (or the model's own)."""
    own = type(model).state_dict(model)
    restored = {k: from_slice(v, own[k]) if k in own else v for k, v in state_dict.items()}
    return type(model).load_state_dict(model, restored, *args, **kwargs)


def _full_state_dict(model: nn.Module, view: Fsdp1View, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """FSDP1's full state dict: every tensor whole (collective: call it on every rank)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=view.offload_to_cpu)
    mine = model.__dict__.pop("state_dict")  # DCP's helper calls model.state_dict(): the class's
    try:
        state = get_model_state_dict(model, options=options)
    finally:
        model.__dict__["state_dict"] = mine
    if view.rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return state


def _options(view: Fsdp1View) -> StateDictOptions:
    return StateDictOptions(full_state_dict=view.full, cpu_offload=view.offload_to_cpu)


def _optim_state_dict(original: Any, model: nn.Module, optim: Any, optim_state_dict: Any = None,
                      group: Any = None) -> dict[str, Any]:
    view = _view(model)
    if view is None:
        return original(model, optim, optim_state_dict, group)
    state = get_optimizer_state_dict(model, optim, options=_options(view))
    if not view.full and _per_tp_rank(view):
        state = _optimizer_slices(model, state, view.shard_mesh)
    if view.rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return state


def _optim_state_dict_to_load(original: Any, model: nn.Module, optim: Any, optim_state_dict: dict,
                              is_named_optimizer: bool = False, load_directly: bool = False,
                              group: Any = None) -> dict[str, Any]:
    view = _view(model)
    if view is None:
        return original(model, optim, optim_state_dict, is_named_optimizer, load_directly, group)
    options = _options(view)
    if _holds_sharded_tensors(optim_state_dict) and not view.full and _per_tp_rank(view):
        optim_state_dict = _slices_from_sharded_tensors(model, optim_state_dict, view)
    elif _holds_sharded_tensors(optim_state_dict):
        optim_state_dict = _whole_from_sharded_tensors(optim_state_dict)
        options = StateDictOptions(full_state_dict=True, cpu_offload=view.offload_to_cpu)
    elif not view.full and _per_tp_rank(view):
        optim_state_dict = _from_slices(model, optim_state_dict)
    set_optimizer_state_dict(model, optim, optim_state_dict, options=options)
    return optim.state_dict()


def _sharded_parameters(model: nn.Module) -> dict[str, Any]:
    """FQN (the optimizer state dict's keys) -> the sharded parameter."""
    mine = {name: model.__dict__.pop(name) for name in ("state_dict", "load_state_dict") if name in model.__dict__}
    try:  # DCP's helper calls model.state_dict(): the class's, not a state_dict_type block's
        return get_model_state_dict(model)
    finally:
        model.__dict__.update(mine)


def _optimizer_slices(model: nn.Module, osd: dict[str, Any], shard_mesh: Any) -> dict[str, Any]:
    """The optimizer state as per-TP-rank slices of each parameter's layout. A state tensor laid
    out otherwise (SGD's momentum copies a gradient that TP left replicated) takes its
    parameter's layout first (a local cut, exact), as SMP v2's state had the slice's shape."""
    params = _sharded_parameters(model)

    def sliced(name: str, v: Any) -> Any:
        p = params.get(name)
        if (isinstance(v, DTensor) and isinstance(p, DTensor) and v.shape == p.shape
                and v.device_mesh == p.device_mesh and v.placements != p.placements):
            v = v.redistribute(p.device_mesh, p.placements)
        return to_slice(v, shard_mesh)

    state = {name: ({k: sliced(name, v) for k, v in per_param.items()} if isinstance(per_param, dict) else per_param)
             for name, per_param in osd.get("state", {}).items()}
    return {**osd, "state": state}


def _from_slices(model: nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict of per-TP-rank slices put back on each parameter's layout."""
    params = _sharded_parameters(model)
    state = {name: ({k: from_slice(v, params[name]) for k, v in per_param.items()}
                    if name in params and isinstance(per_param, dict) else per_param)
             for name, per_param in osd.get("state", {}).items()}
    return {**osd, "state": state}


def _holds_sharded_tensors(osd: Any) -> bool:
    sharded = sharded_tensor_type()
    state = osd.get("state", {}) if isinstance(osd, dict) else {}
    return any(isinstance(v, sharded) for per_param in state.values() if isinstance(per_param, dict)
               for v in per_param.values())


def _whole_from_sharded_tensors(osd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state of torch's `load_sharded_optimizer_state_dict` (FSDP1's
    ShardedTensors, each cut in row chunks over all ranks, every rank reading its chunk from its
    own checkpoint folder) as whole tensors on every rank (collective: every rank calls it).

    Exact when every rank's folder holds every tensor whole: a checkpoint saved by the data-
    parallel ranks of one replica. Under tensor parallelism the sharded block's load is
    `_slices_from_sharded_tensors`; outside it, and under expert parallelism (one folder per EP
    rank) or pipelining (the stages hold different tensors), refused, naming the load that works."""
    import smp

    st = smp.state
    _refuse_sharded_optimizer_across_ranks(st)
    if st.tp_size > 1:
        raise MigrationError(
            "FSDP.optim_state_dict_to_load(model, optimizer, osd) with the ShardedTensors of "
            "torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict under "
            f"tensor_parallel_degree {st.tp_size}, outside FSDP.state_dict_type(model, "
            "SHARDED_STATE_DICT): each per-TP-rank folder holds that TP rank's slices, which only "
            "the sharded state dict describes. Call model.state_dict(), "
            "load_sharded_optimizer_state_dict(model_state_dict=...) and "
            f"FSDP.optim_state_dict_to_load inside that block (see {section('checkpoints')})"
        )
    return {**osd, "state": _each_whole(osd, st.device, None, lambda name, key, value: value)}


def _refuse_sharded_optimizer_across_ranks(st: Any) -> None:
    """Per-EP-rank folders and pipeline stages: torch's loader would read parts of the state from
    no folder (refused, naming the load that works)."""
    if st.ep_size > 1 or st.pp_size > 1:
        raise MigrationError(
            "FSDP.optim_state_dict_to_load(model, optimizer, osd) with the ShardedTensors of "
            "torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict under "
            f"expert_parallel_degree {st.ep_size} / pipeline_parallel_degree {st.pp_size}: that "
            "loader cuts each tensor in row chunks over the ranks and reads each rank's chunk from "
            "its own per-EP-rank folder, which holds only that rank's experts (under pipelining, "
            "the ranks hold different tensors), so parts of the state would be read by no rank. "
            "Load the optimizer with the model instead: "
            "state = {'optimizer': FSDP.optim_state_dict(model, optimizer), ...}; "
            "state_dict_loader.load(state, ...) (or torch.distributed.checkpoint.load); "
            "FSDP.optim_state_dict_to_load(model, optimizer, state['optimizer']) "
            f"(see {section('checkpoints')})"
        )


def _each_whole(osd: dict[str, Any], device: torch.device, group: Any, place: Any) -> dict[str, Any]:
    """The optimizer state with each ShardedTensor made whole over `group` (None: all ranks) and
    every value passed through `place(name, key, value)`. Names and keys in sorted order, the
    same on every rank: one all_reduce per tensor."""
    sharded = sharded_tensor_type()
    state: dict[str, Any] = {}
    for name in sorted(osd["state"]):
        state[name] = {}
        for key in sorted(osd["state"][name]):
            value = osd["state"][name][key]
            if isinstance(value, sharded):
                value = _whole(value, device, group)
            state[name][key] = place(name, key, value)
    return state


def _slices_from_sharded_tensors(model: nn.Module, osd: dict[str, Any], view: Fsdp1View) -> dict[str, Any]:
    """Under tensor parallelism: the optimizer state of torch's `load_sharded_optimizer_state_dict`
    on each parameter's layout. Each rank of `model.process_group` read its row chunk of its TP
    rank's slices from that TP rank's folder (the session gave the loader that group: see the
    module's docstring); a sum over the group makes each slice whole (exact), and each rank keeps
    its part of it, as the parameter holds its own (collective over model.process_group)."""
    import smp

    st = smp.state
    _refuse_sharded_optimizer_across_ranks(st)
    params = _sharded_parameters(model)

    def place(name: str, key: str, value: Any) -> Any:
        p = params.get(name)
        if not (isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0):
            return value  # (a step count)
        return local_part(value, p, view.shard_mesh)

    return {**osd, "state": _each_whole(osd, st.device, view.process_group, place)}


def _slice_group(model_state_dict: Any) -> Any:
    """For torch's `load_sharded_optimizer_state_dict` (see the module's docstring): the group to
    chunk the optimizer state over when `model_state_dict` holds per-TP-rank slices (the sharded
    state dict of a model transform sharded, taken under tensor parallelism), else None."""
    import smp

    if not (isinstance(model_state_dict, dict) and smp.is_initialized() and smp.state.tp_size > 1):
        return None
    mesh = shard_mesh(smp.state)
    tensors = [v for v in model_state_dict.values() if isinstance(v, DTensor)]
    if not any(t.device_mesh == mesh for t in tensors) or any(slice_shape(t) is not None for t in tensors):
        return None  # not sliced: torch's answer stands, and optim_state_dict_to_load refuses the result
    return mesh.get_group()


def _whole(t: Any, device: torch.device, group: Any = None) -> torch.Tensor:
    """A ShardedTensor's whole tensor: each rank writes its chunks into zeros, a sum over the
    ranks of `group` (None: all) fills the rest (the chunks do not overlap, and x + 0 is x: exact)."""
    meta = t.metadata()
    members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    if any(s.placement.rank() not in members for s in meta.shards_metadata):
        raise MigrationError(
            f"a ShardedTensor of shape {tuple(meta.size)} from load_sharded_optimizer_state_dict is cut "
            f"over ranks {sorted(s.placement.rank() for s in meta.shards_metadata)}, not over "
            f"model.process_group (ranks {list(members)}), whose ranks read one per-TP-rank folder: pass "
            "load_sharded_optimizer_state_dict the "
            "model_state_dict taken by model.state_dict() inside FSDP.state_dict_type(model, "
            f"SHARDED_STATE_DICT) during the smp.sagemaker session (see {section('checkpoints')})"
        )
    whole = torch.zeros(meta.size, dtype=meta.tensor_properties.dtype, device=device)
    covered = 0
    for shard in t.local_shards():
        region = whole
        for dim, (offset, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
            region = region.narrow(dim, offset, size)
        region.copy_(shard.tensor)
        covered += region.numel()
    counts = torch.tensor([covered], dtype=torch.int64, device=device)
    dist.all_reduce(whole, group=group)
    dist.all_reduce(counts, group=group)
    if int(counts) != whole.numel():  # the chunks tile the tensor exactly once
        raise MigrationError(
            f"a ShardedTensor of shape {tuple(meta.size)} from load_sharded_optimizer_state_dict covers "
            f"{int(counts)} of its {whole.numel()} elements over the ranks: call "
            f"FSDP.optim_state_dict_to_load on every rank (see {section('checkpoints')})"
        )
    return whole


def _offload_wrapper(original: Any, module: nn.Module) -> nn.Module:
    """SMP v2 answered the script's `offload_wrapper(model)` with its own offloading; smp's
    transform already offloads (the config's activation_offloading): the model comes back as is."""
    if _view(module) is None:
        return original(module)
    import smp

    if not smp.state.config.activation_offloading:
        raise MigrationError(
            "offload_wrapper(model) on a model smp.sagemaker.transform sharded: smp offloads "
            "activations itself when the config says sm_activation_offloading: true; set it there "
            f"and drop the call (see {section('fsdp-wrapping')})"
        )
    return module


def _fsdp1_wrap_message(module_name: str) -> str:
    return (
        f"FullyShardedDataParallel({module_name}, ...) wraps a model that smp.sagemaker.transform "
        "already sharded (FSDP2, torch.distributed.fsdp.fully_shard). SMP v2 scripts wrap the "
        "transformed model in FSDP1 themselves; with smp delete that call and keep using the model "
        "transform returned: sharding_strategy is hybrid_shard_degree, mixed_precision and "
        "auto_wrap_policy are the config's mixed_precision and shard_modules, param_init_fn is "
        "done (transform materialises meta models), sync_module_states is "
        f"transform(..., load_state_dict_from_rank0=True) (see {section('fsdp-wrapping')})"
    )


def _guarded_init(original: Any, self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
    if isinstance(module, nn.Module) and (_view(module) is not None
                                          or any(isinstance(m, FSDPModule) for m in module.modules())):
        raise MigrationError(_fsdp1_wrap_message(type(module).__name__))
    original(self, module, *args, **kwargs)


class Fsdp1Patch:
    """FSDP1's class with the replacements above, and the group of torch's sharded optimizer
    loader; `remove` puts torch's back."""

    def __init__(self) -> None:
        cls = FullyShardedDataParallel
        self._saved = {name: cls.__dict__[name] for name in
                       ("__init__", "state_dict_type", "optim_state_dict", "optim_state_dict_to_load")}
        init, sdt, osd, to_load = (self._saved[n] for n in self._saved)

        @functools.wraps(init)
        def guarded_init(fsdp: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
            _guarded_init(init, fsdp, module, *args, **kwargs)

        cls.__init__ = guarded_init
        cls.state_dict_type = staticmethod(contextlib.contextmanager(functools.partial(_state_dict_type, sdt.__func__)))
        cls.optim_state_dict = staticmethod(functools.partial(_optim_state_dict, osd.__func__))
        cls.optim_state_dict_to_load = staticmethod(functools.partial(_optim_state_dict_to_load, to_load.__func__))

        wrappers = checkpoint_wrapper_module()
        self._offload = wrappers.offload_wrapper
        wrappers.offload_wrapper = functools.partial(_offload_wrapper, self._offload)
        self._undo_loader_group = patch_optimizer_loader_group(_slice_group)

    def remove(self) -> None:
        for name, value in self._saved.items():
            setattr(FullyShardedDataParallel, name, value)
        checkpoint_wrapper_module().offload_wrapper = self._offload
        self._undo_loader_group()
