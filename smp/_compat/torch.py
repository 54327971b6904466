"""torch's private names smp reaches (checked on torch 2.9-2.14; each accessor names its versions)."""

from __future__ import annotations

import contextlib
import datetime
import importlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp._compat.versions import unsupported, require_torch, _private

# ----------------------------------------------------------------------------------------------
# torch: pytree and dispatch modes
# ----------------------------------------------------------------------------------------------

# torch.utils._pytree: no public module on 2.9-2.14 (torch.utils.pytree does not exist there).
_pytree = importlib.import_module("torch.utils._pytree")
tree_leaves = _pytree.tree_leaves
tree_map_only = _pytree.tree_map_only

# The base class of dispatch modes (torch.utils._python_dispatch, checked 2.9-2.14; torch has no
# public name for it). Where it is missing, using a mode built on it raises.
_dispatch_mode = _private("torch.utils._python_dispatch", "TorchDispatchMode")
if _dispatch_mode is None:  # pragma: no cover - no supported torch lacks it

    class TorchDispatchMode:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise unsupported(f"{type(self).__name__} (a torch dispatch mode)")

else:
    TorchDispatchMode = _dispatch_mode


def op_name(func: Any) -> str:
    """"namespace::op" of an OpOverload (overload not included), as in its schema. OpOverload's
    `_schema` (checked 2.9-2.14); `name()` is public but includes the overload."""
    return func._schema.name


# The types of torch.ops.aten.mm.default and torch.ops.aten.mm (torch._ops, 2.9-2.14).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

# Every Python object that computes scaled-dot-product attention: the public function and the
# C binding it forwards to (which some models call directly). torch._C._nn, checked 2.9-2.14.
SDPA_FUNCTIONS = frozenset(
    f for f in (F.scaled_dot_product_attention, getattr(getattr(torch._C, "_nn", None), "scaled_dot_product_attention", None))
    if f is not None
)


# ----------------------------------------------------------------------------------------------
# torch: tensors and autograd
# ----------------------------------------------------------------------------------------------


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (a forward seen then is an
    activation-checkpoint recompute). torch has no public test: `torch._C._current_graph_task_id`
    (-1 outside backward), checked 2.9-2.14."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:
        raise unsupported("telling a checkpoint recompute from a forward (torch._C._current_graph_task_id)")
    return current() != -1


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` once the backward now running has finished (call it from inside that
    backward, e.g. a gradient hook): `Variable._execution_engine.queue_callback`, 2.9-2.14 (what
    FSDP2 uses for its end of backward); torch has no public name for it."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """`container` with `fn` applied to every tensor in it (tuples, lists, dicts, dataclasses,
    named tuples), as FSDP2 casts a unit's inputs and outputs: `torch.distributed.utils.
    _apply_to_tensors`, 2.9-2.14."""
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(fn, container)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (None when it is not a view): `Tensor._base`, 2.9-2.14."""
    return t._base


def version_counter(t: torch.Tensor) -> int:
    """The in-place modification counter of `t`: `Tensor._version`, 2.9-2.14."""
    return t._version


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor as it is stored, outside autograd (`DTensor.to_local()` is
    the public, differentiable way; hooks and dispatch modes need the stored tensor):
    `DTensor._local_tensor`, 2.9-2.14. Other tensors are returned as they are."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_spec(t: torch.Tensor) -> Any:
    """A DTensor's spec (mesh, placements, global shape and stride in one object, which
    `DTensor.from_local` does not take whole): `DTensor._spec`, 2.9-2.14; None for others."""
    from torch.distributed.tensor import DTensor

    return t._spec if isinstance(t, DTensor) else None


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t.full_tensor()` for a DTensor (other tensors as they are), also for the layouts torch
    2.11 cannot redistribute: it reads every `_StridedShard` as a shard order and refuses one
    that is not ("use_strided_shard_as_shard_order is True, but placements: (Shard(dim=0),
    _StridedShard(dim=1, sf=3)) is unable to be interpreted ..."), which is the layout of
    fused-QKV tensor-parallel weights under FSDP. There the gather runs on a copy of the spec
    that keeps `_StridedShard` as a placement of its own (`use_strided_shard_as_shard_order=
    False`, the DTensorSpec field 2.11 added; 2.9 and 2.13-2.14 gather directly). The fallback
    is not differentiable: use it on values (checks, exports), not inside a loss."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    spec = t._spec
    if not getattr(spec, "use_strided_shard_as_shard_order", False):
        return t.full_tensor()
    try:
        return t.full_tensor()
    except ValueError:  # raised while planning the redistribution, on every rank alike
        import dataclasses

        plain = dataclasses.replace(spec, use_strided_shard_as_shard_order=False, shard_order=None)
        return DTensor(t._local_tensor.detach(), plain, requires_grad=False).full_tensor()


def dtensor_from_spec(local: torch.Tensor, spec: Any, requires_grad: bool) -> torch.Tensor:
    """A DTensor from its local shard and a spec taken with `dtensor_spec` (the DTensor
    constructor, 2.9-2.14, takes exactly these)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=requires_grad)


# ----------------------------------------------------------------------------------------------
# torch: nn.Module internals
# ----------------------------------------------------------------------------------------------


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameter slots, the live dict (writing a key replaces the parameter
    without the checks of `register_parameter`, e.g. to put a DTensor or a plain tensor there):
    `nn.Module._parameters`, 2.9-2.14. Reading only: `module.named_parameters(recurse=False)`."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffer slots, the live dict: `nn.Module._buffers`, 2.9-2.14."""
    return module._buffers


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of the module's own buffers left out of its state dict:
    `nn.Module._non_persistent_buffers_set`, 2.9-2.14."""
    return module._non_persistent_buffers_set


def own_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's own submodule slots, the live dict (a slot may hold None, which keeps the
    name registered): `nn.Module._modules`, 2.9-2.14. Reading only: `named_children()`."""
    return module._modules


def add_parameter_slot(module: nn.Module, name: str, value: nn.Parameter | None) -> None:
    """Put `value` in the module's parameter slot `name` as it is (see `own_parameters`)."""
    module._parameters[name] = value


# The attributes that make a module call more than `forward`: its hook dicts (2.9-2.14) and
# torch.compile's replacement of the call (`_compiled_call_impl`, 2.9-2.14).
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks",
)


@contextlib.contextmanager
def without_hooks(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Every module of `modules` called without its hooks (FSDP's, tensor parallel's, ...) and
    without a compiled call, restored on exit. Hooks registered inside are dropped on exit."""
    saved = {}
    for module in modules:
        for attr in _HOOK_DICTS:
            if not hasattr(module, attr):
                raise unsupported(f"calling {type(module).__name__} without its hooks (nn.Module.{attr})")
        saved[module] = {attr: getattr(module, attr) for attr in _HOOK_DICTS}
        saved[module]["_compiled_call_impl"] = getattr(module, "_compiled_call_impl", None)
        for attr in _HOOK_DICTS:
            setattr(module, attr, OrderedDict())
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, attrs in saved.items():
            for attr, value in attrs.items():
                setattr(module, attr, value)


def apply_style(style: Any, module: nn.Module, device_mesh: Any) -> nn.Module:
    """Apply a tensor-parallel `ParallelStyle` to `module`: its `_apply`, the method torch's
    custom-style API asks subclasses to implement (2.9-2.14; `parallelize_module` calls it)."""
    return style._apply(module, device_mesh)


def style_io_functions(style: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(prepare_input_fn, prepare_output_fn) of a ColwiseParallel / RowwiseParallel style, the
    input and output hooks its `_apply` passes to `distribute_module` (called with the layouts
    first: `partial(fn, input_layouts, desired_input_layouts)`): `_prepare_input_fn` /
    `_prepare_output_fn`, 2.9-2.14 (torch has no public name for them)."""
    prepare_input = getattr(style, "_prepare_input_fn", None)
    prepare_output = getattr(style, "_prepare_output_fn", None)
    if prepare_input is None or prepare_output is None:
        raise unsupported(f"a custom tensor-parallel style built on {type(style).__mro__[1].__name__}")
    return prepare_input, prepare_output


def check_sequence_parallel() -> None:
    """Refuse tensor-parallel sequence parallelism on a torch that cannot run it: torch 2.9's
    DTensor has no sharding rule for `aten.alias`, which transformers' causal-LM heads apply to
    the sequence-sharded hidden states (`hidden_states[:, slice(0, None), :]`), so the forward
    fails there. Seen failing on 2.9.1, working on 2.11.0, 2.13.0, 2.14.1 (2.10 not tested)."""
    require_torch((2, 11), "tensor_parallel.sequence_parallel",
                  "torch 2.9 has no DTensor rule for aten.alias, which transformers' causal-LM heads run on "
                  "the sequence-sharded hidden states: set tensor_parallel.sequence_parallel to false, or "
                  "install torch >= 2.11.")


# ----------------------------------------------------------------------------------------------
# torch.distributed: process groups, meshes, functional collectives
# ----------------------------------------------------------------------------------------------


def default_store() -> dist.Store:
    """The store of the default process group: `distributed_c10d._get_default_store`, 2.9-2.14."""
    return dist.distributed_c10d._get_default_store()


def group_is_alive(group: dist.ProcessGroup) -> bool:
    """True while `group` is registered (not destroyed): torch keeps them in the private
    `distributed_c10d._world.pg_map` (2.9-2.14; no public query)."""
    return group in dist.distributed_c10d._world.pg_map


def set_group_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Set the timeout of every backend of `group` for the operations that follow. Public
    `torch.distributed.set_timeout` from 2.14 (2.15 deprecates the private one); before that the
    private `distributed_c10d._set_pg_timeout` (2.9-2.13)."""
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
        return
    private = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if private is None:
        raise unsupported("setting a process group's timeout (distributed.timeout_seconds)")
    private(timeout, group)


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta:
    """The timeout `group`'s backend for `device` uses now. torch has no public getter: the
    backend's `options._timeout` via `ProcessGroup._get_backend` (2.9-2.14)."""
    return group._get_backend(device).options._timeout


def flatten_mesh(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    """`mesh[dims]` flattened into one dimension called `name`, registered on the root mesh so
    that `root[name]` finds it: `DeviceMesh._flatten` (2.9-2.14; torch has no public name).

    torch 2.9 cannot flatten a slice that holds an already-flattened dimension ("tuple.index(x):
    x not in tuple"): there the flattened names in `dims` are replaced by the root dimensions
    they were made of (the same ranks, in the same order), from the mesh registry's
    `flatten_name_to_root_dims` (2.9 only; 2.11-2.14 flatten such slices themselves)."""
    import torch.distributed.device_mesh as device_mesh

    resources = getattr(device_mesh, "_mesh_resources", None)
    flattened = getattr(resources, "flatten_name_to_root_dims", None)
    if isinstance(flattened, dict):  # torch 2.9
        root = resources.get_root_mesh(mesh)
        made_of = flattened.get(root, {})
        names = root.mesh_dim_names or ()
        dims = tuple(n for d in dims for n in ((names[i] for i in made_of[d]) if d in made_of else (d,)))
        mesh = root
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    if not hasattr(sub, "_flatten"):
        raise unsupported("flattening device-mesh dimensions (DeviceMesh._flatten)")
    return sub._flatten(name)


def drop_cached_groups(mesh: Any) -> None:
    """Drop the process groups `mesh` caches, once they are destroyed, so that the mesh (which
    outlives shutdown in whatever still references it) does not keep them alive until
    finalization. torch 2.11-2.14 cache them in the root mesh's `_pg_registry` (a dict); 2.9
    caches only group names (`_dim_group_names`), which keep nothing alive: nothing to drop.
    Any other layout raises: a silent skip would leave gloo threads running into finalization."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()
    elif not hasattr(mesh, "_dim_group_names"):
        raise unsupported("releasing a DeviceMesh's process groups at smp.shutdown")


def _gather_grad_contiguous() -> type[torch.autograd.Function]:
    class _ContiguousGrad(torch.autograd.Function):
        """Identity whose backward hands on a contiguous gradient (torch 2.9-2.12's autograd
        all-gather reduce-scatters its gradient as it comes, and refuses a strided one)."""

        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.view_as(t)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad.contiguous()

    return _ContiguousGrad


_CONTIGUOUS_GRAD: type[torch.autograd.Function] | None = None


def all_gather_autograd(t: torch.Tensor, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The tensors of `group` concatenated along `gather_dim`, differentiable (backward
    reduce-scatters the gradient). `_functional_collectives.all_gather_single_autograd` (2.13,
    2.14); before, `all_gather_tensor_autograd` (2.9-2.12), whose backward needs a contiguous
    gradient: smp makes it so."""
    global _CONTIGUOUS_GRAD
    funcol = importlib.import_module("torch.distributed._functional_collectives")
    single = getattr(funcol, "all_gather_single_autograd", None)
    if single is not None:
        out = single(t.contiguous(), gather_dim=gather_dim, group=group)
    else:
        older = getattr(funcol, "all_gather_tensor_autograd", None)
        if older is None:
            raise unsupported("a differentiable all-gather (expert-parallel load-balancing loss)")
        out = older(t.contiguous(), gather_dim=gather_dim, group=group)
        out = out.wait() if hasattr(out, "wait") else out
        if _CONTIGUOUS_GRAD is None:
            _CONTIGUOUS_GRAD = _gather_grad_contiguous()
        out = _CONTIGUOUS_GRAD.apply(out)
    return out.wait() if hasattr(out, "wait") else out  # an AsyncCollectiveTensor until used


def all_to_all_autograd(
    t: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all with uneven splits (backward sends the gradients back):
    `_functional_collectives.all_to_all_single_autograd`, 2.9-2.14 (the public
    `torch.distributed.nn.functional.all_to_all_single` is deprecated in its favour)."""
    fn = _private("torch.distributed._functional_collectives", "all_to_all_single_autograd")
    if fn is None:
        raise unsupported("a differentiable all-to-all (expert-parallel token dispatch)")
    out = fn(t.contiguous(), output_splits, input_splits, group)
    return out.wait() if hasattr(out, "wait") else out


def strided_shard_type() -> type:
    """torch's placement for a dim sharded twice (FSDP over a TP shard; fused QKV slices):
    `placement_types._StridedShard`, 2.9-2.14, no public name."""
    cls = _private("torch.distributed.tensor.placement_types", "_StridedShard")
    if cls is None:
        raise unsupported("strided shard placements (_StridedShard)")
    return cls


def strided_shard(dim: int, split_factor: int) -> Any:
    """The placement `_StridedShard(dim, split_factor=split_factor)` (see `strided_shard_type`)."""
    return strided_shard_type()(dim, split_factor=split_factor)


def fake_store() -> Any:
    """A store for torch's fake process group (one process stands in for any rank of a large
    world): `torch.testing._internal.distributed.fake_pg.FakeStore`, 2.9-2.14. Importing it
    registers the "fake" backend."""
    cls = _private("torch.testing._internal.distributed.fake_pg", "FakeStore")
    if cls is None:
        raise unsupported("planning on a fake process group (smp plan)")
    return cls()


# ----------------------------------------------------------------------------------------------
# torch.distributed.fsdp (FSDP2) internals
# ----------------------------------------------------------------------------------------------


def fsdp_unit_params(module: Any) -> list[Any] | None:
    """The FSDPParams of an FSDPModule's own unit (None when it manages no parameters):
    `_get_fsdp_state()._fsdp_param_group.fsdp_params`, 2.9-2.14."""
    state = module._get_fsdp_state()
    group = getattr(state, "_fsdp_param_group", None) if state is not None else None
    return None if group is None else list(group.fsdp_params)


def fsdp_sharded_data(fsdp_param: Any) -> torch.Tensor:
    """The flat padded shard FSDP allocates for one parameter on this rank:
    `FSDPParam._sharded_param_data`, 2.9-2.14."""
    return fsdp_param._sharded_param_data


def fsdp_reshard_after_forward_onto(module: Any, mesh: Any) -> None:
    """Make FSDP unit `module` keep its parameters sharded over dim 1 of the 2-D `mesh` between
    forward and backward, as `fully_shard(reshard_after_forward=<dim 1's size>)` does, but over
    a mesh the caller built once for every unit. (fully_shard builds one per unit from
    `mesh.mesh.view(-1, k)`, the rank's own slice only: over a 1-D submesh of a larger world the
    ranks of different slices then create differently-ranked groups under the same names, and
    hang; and one mesh per unit is one communicator per unit.) Sets the unit's and each
    FSDPParam's `post_forward_mesh_info` (an `HSDPMeshInfo`, replicate dim 0, as fully_shard
    builds) and recomputes `FSDPParam._init_sharded_post_forward_param_metadata` from the
    parameter's original size (`_orig_size`), 2.9-2.14."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    group = module._get_fsdp_state()._fsdp_param_group
    group.post_forward_mesh_info = info
    for fsdp_param in group.fsdp_params:
        fsdp_param.post_forward_mesh_info = info
        fsdp_param._init_sharded_post_forward_param_metadata(torch.empty(fsdp_param._orig_size, device="meta"))


def root_mesh(mesh: Any) -> Any:
    """The DeviceMesh `mesh` was sliced from (itself when it is one): `DeviceMesh._get_root_mesh`
    (2.11-2.14), `_mesh_resources.get_root_mesh` (2.9). Its `.mesh` holds every rank."""
    if hasattr(mesh, "_get_root_mesh"):
        return mesh._get_root_mesh()
    import torch.distributed.device_mesh as device_mesh

    resources = getattr(device_mesh, "_mesh_resources", None)
    if resources is None or not hasattr(resources, "get_root_mesh"):
        raise unsupported("finding the root of a sliced DeviceMesh")
    return resources.get_root_mesh(mesh)


# ----------------------------------------------------------------------------------------------
# torch.distributed.checkpoint
# ----------------------------------------------------------------------------------------------


def set_element(root: dict, path: tuple, value: Any) -> None:
    """Write `value` at `path` (keys and list indices) inside a nested state dict, creating the
    containers on the way, as DCP's loaders do: `checkpoint._traverse.set_element`, 2.9-2.14."""
    fn = _private("torch.distributed.checkpoint._traverse", "set_element")
    if fn is None:
        raise unsupported("loading nested state dict entries (checkpoint._traverse.set_element)")
    fn(root, path, value)




# --- smp.sagemaker: FSDP1-era helpers SMP v2 scripts call (checked on torch 2.13.0) ----------

def checkpoint_wrapper_module() -> Any:
    """`torch.distributed.algorithms._checkpoint.checkpoint_wrapper`, which holds the
    `offload_wrapper` SMP v2 scripts apply to the model (no public home in torch 2.13)."""
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as module

    return module


def sharded_tensor_type() -> type:
    """FSDP1's `ShardedTensor` (`torch.distributed._shard.sharded_tensor`; no public home in torch
    2.13), which torch's `load_sharded_optimizer_state_dict` still returns for an FSDP2 model."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor



def patch_optimizer_loader_group(find_group: Callable[[Any], Any]) -> Callable[[], None]:
    """Let torch's `load_sharded_optimizer_state_dict` (torch.distributed.checkpoint.optimizer)
    cut the optimizer state over `find_group(model_state_dict)` instead of the whole world;
    returns the undo.

    The loader looks for a group with the private `_get_state_dict_2d_layout(model_state_dict)`,
    which recognises only FSDP1's 2-D layout (ShardedTensors nested in ShardedTensors; its
    group path also fails on torch 2.13 for a group that is not ranks 0..n-1: the specs name
    group ranks where ShardedTensor checks global ones). For any other state dict it cuts every
    tensor in row chunks over the world with the private `_create_chunk_sharded_tensor(tensor,
    rank=, world_size=, num_devices_per_node=, pg=)`, each rank reading its chunk through its
    own storage reader. Patched here: where torch finds no group and `find_group` answers one,
    those chunks are cut over that group (its rank, size and group: the call FSDP1 itself makes
    for a sub-group). Both names checked on torch 2.13.0 (the loader has made these calls since
    2.1; it takes no process_group argument, so torch has no public way). Where either name is
    missing nothing is patched and the undo does nothing."""
    import functools

    module = importlib.import_module("torch.distributed.checkpoint.optimizer")
    layout0 = getattr(module, "_get_state_dict_2d_layout", None)
    chunk0 = getattr(module, "_create_chunk_sharded_tensor", None)
    if layout0 is None or chunk0 is None:
        return lambda: None
    chosen: list[Any] = [None]  # the group find_group chose for the loader call running now

    @functools.wraps(layout0)
    def layout(state_dict: Any) -> Any:
        specs, group = layout0(state_dict)
        chosen[0] = find_group(state_dict) if group is None else None
        return specs, group

    @functools.wraps(chunk0)
    def chunk(tensor: torch.Tensor, rank: int, world_size: int, num_devices_per_node: int, pg: Any,
              device: Any = None) -> Any:
        group = chosen[0]
        if group is not None:
            rank, world_size, pg = dist.get_rank(group), dist.get_world_size(group), group
        return chunk0(tensor, rank=rank, world_size=world_size, num_devices_per_node=num_devices_per_node,
                      pg=pg, device=device)

    module._get_state_dict_2d_layout = layout
    module._create_chunk_sharded_tensor = chunk

    def undo() -> None:
        if module._get_state_dict_2d_layout is layout:
            module._get_state_dict_2d_layout = layout0
        if module._create_chunk_sharded_tensor is chunk:
            module._create_chunk_sharded_tensor = chunk0

    return undo
