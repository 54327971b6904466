"""Delayed (meta-device) initialisation: materialise a sharded model one module at a time.

A model built under `torch.device("meta")` holds no memory. After `fully_shard` its parameters
are meta DTensors; `materialize_meta_model` allocates only each rank's shards and fills them so
that they equal the eager init for the same seed:

- eager construction draws the RNG in each module's `reset_parameters()` and, for transformers
  models, in `initialize_weights()` at the end of each PreTrainedModel's __init__; `_Replay`
  re-runs those calls in construction order, on full-size temporary tensors of one module at a
  time (peak extra memory: about one FSDP unit's parameters), keeping this rank's shard.

Every rank computes the same full values (same seed), so no rank sends data to another in the
first pass; the second gathers one module at a time.

Any meta model is accepted the same way, whoever built it: `smp.init_context()`,
`torch.device("meta")`, accelerate's `init_empty_weights()` (which leaves buffers real and marks
modules `_is_hf_initialized`) or transformers' own meta loading. Tensors the model already holds
for real are kept; every other value is written by the replay, and a value that no init call
re-creates (a constructor-only buffer) is refused by name rather than left as garbage.

The replay reproduces eager values only if it draws the random generator exactly as eager
construction did before each init. A transformers constructor can draw outside any init call (a
parameter drawn in __init__, a module built and then replaced): every later value would shift.
For a transformers model this is proven, not assumed: its class is rebuilt from its config on
the meta device (no memory, inits skipped as transformers does on meta) recording every random
draw, and the replay's draws must be the same sequence, or the model is refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from smp._compat import (
    TorchDispatchMode, add_parameter_slot, clear_initialized_marks, init_weights_function, own_buffers, own_parameters,
)
from smp.errors import ConfigError


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _swap_entries(
    module: nn.Module, recurse: bool, stop_at: frozenset[int] = frozenset()
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner module, name, param) for `module`'s sharded (DTensor) and meta parameters; with
    `recurse`, also its descendants' down to (not into) other FSDP units and the modules of
    `stop_at`, so one swap never spans two units."""
    entries = []
    stack = [module]
    while stack:
        current = stack.pop()
        for name, param in own_parameters(current).items():
            if isinstance(param, DTensor) or (param is not None and param.is_meta):
                entries.append((current, name, param))
        if recurse:
            stack.extend(c for c in current.children() if not isinstance(c, FSDPModule) and id(c) not in stop_at)
    return entries


@contextmanager
def _full_parameters(
    module: nn.Module, gather: bool, first_owner: dict[int, int], recurse: bool = False,
    scratch: torch.device | None = None, stop_at: frozenset[int] = frozenset(),
) -> Iterator[None]:
    """Swap sharded parameters for plain full tensors during an init call, then keep the shards.

    Each (module, name) gets its own temporary: eager construction ties weights only after
    initialising them, so a tied copy (an LM head tied to the embedding) draws the RNG into
    its own tensor and only the first owner's values are kept. A parameter still on the meta
    device (another pipeline stage's) gets a temporary on `scratch`, so that its init draws the
    generator as eager construction did, and its values are dropped.
    """
    entries = [e for e in _swap_entries(module, recurse, stop_at) if scratch is not None or isinstance(e[2], DTensor)]
    for owner, name, param in entries:
        if not isinstance(param, DTensor):
            full = torch.empty(param.shape, dtype=param.dtype, device=scratch)
        elif gather:
            full = param.full_tensor()
            if full.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr():
                full = full.clone()  # an unsharded mesh returns the shard itself: never alias it
        else:
            full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        add_parameter_slot(owner, name, nn.Parameter(full, requires_grad=param.requires_grad))
    try:
        yield
    finally:
        for owner, name, param in entries:
            full = own_parameters(owner)[name].detach()
            add_parameter_slot(owner, name, param)
            if first_owner.get(id(param)) != id(owner) or not isinstance(param, DTensor):
                continue
            # src_data_rank=None: every rank slices its own shard from identical local data.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            with torch.no_grad():
                param.to_local().copy_(local.to_local())


def _is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def _init_conv1d(module: nn.Module) -> None:
    nn.init.normal_(module.weight, std=0.02)  # transformers.pytorch_utils.Conv1D.__init__


# Known classes that draw the RNG in __init__ rather than in a reset_parameters() (GPT-2's
# Conv1D): the replay must draw exactly as they do, or every later module gets other values.
_CONSTRUCTOR_INITS: dict[str, Callable[[nn.Module], None]] = {"Conv1D": _init_conv1d}


class _RecordDraws(TorchDispatchMode):
    """Appends (op, shape) to `draws` for every op that consumes the random generator: the CPU
    generator's position after a draw depends only on the op and the number of values drawn."""

    def __init__(self, draws: list[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.draws.append((str(func.overloadpacket), tuple(first.shape) if isinstance(first, torch.Tensor) else ()))
        return out


class _Replay:
    """Re-runs the RNG draws of eager construction, in construction order.

    A module's children are built (and draw) before the module's own `reset_parameters()` runs
    at the end of its __init__; a transformers PreTrainedModel ends its __init__ by running
    `initialize_weights()` over its subtree (post-order, skipping modules a nested
    PreTrainedModel already initialised). Verified bitwise against eager construction.
    """

    def __init__(self, model: nn.Module, scratch: torch.device | None = None,
                 stop_at: frozenset[int] = frozenset()) -> None:
        # scratch: where meta parameters (other pipeline stages') get their throw-away values;
        # stop_at: modules an ancestor's init call does not reach into (each is initialised
        # on its own visit), bounding the throw-away memory to one of them at a time.
        self.scratch, self.stop_at = scratch, stop_at
        self.hf_done: set[int] = set()
        # Each parameter's value is written through one owner module; a tied copy elsewhere (an
        # LM head tied to the embedding) draws the RNG into its own temporary, not kept.
        self.first_owner = _value_owners(model)
        # The constructor-phase draws (reset_parameters and constructor inits, not transformers'
        # initialize_weights) with the module drawing each, for `_check_same_draws`.
        self.draws: list[tuple[str, tuple[int, ...]]] = []
        self.drawn_by: list[str] = []
        self.names = {id(m): name for name, m in model.named_modules()}

    def construct(self, module: nn.Module) -> None:
        for child in module.children():
            self.construct(child)
        reset = getattr(module, "reset_parameters", None)
        constructor_init = _CONSTRUCTOR_INITS.get(type(module).__name__)
        if callable(reset) or constructor_init is not None:
            before = len(self.draws)
            with _full_parameters(module, gather=False, first_owner=self.first_owner, scratch=self.scratch):
                with _RecordDraws(self.draws):
                    reset() if callable(reset) else constructor_init(module)
            self.drawn_by += [self.names.get(id(module), "?")] * (len(self.draws) - before)
        if _is_hf_model(module):
            self._hf_initialize(module)

    def _hf_initialize(self, model: nn.Module) -> None:
        from transformers import initialization as hf_init

        # FSDP2 re-classes a sharded module (FSDPT5ForConditionalGeneration), whose module path
        # would make transformers treat it as remote code and skip its own-parameter-less inits
        # (T5's root init of the shared embedding): ask the user's class, as eager construction did.
        is_custom = _user_class(model).is_custom_code()

        def visit(module: nn.Module, init_fn: Callable) -> None:
            for child in module.children():
                visit(child, init_weights_function(child) if _is_hf_model(child) else init_fn)
            if id(module) not in self.hf_done:
                # recurse: an init may write a child's weight (GPT-2 scales attn.c_proj).
                with _full_parameters(module, gather=True, first_owner=self.first_owner, recurse=True,
                                      scratch=self.scratch, stop_at=self.stop_at):
                    init_fn(module, is_custom)
                self.hf_done.add(id(module))

        with hf_init.guard_torch_init_functions():
            visit(model, init_weights_function(model))


def _eager_construction_draws(model: nn.Module) -> list[tuple[str, tuple[int, ...]]] | str:
    """The random draws of building `model`'s transformers class from its config, before
    transformers' initialize_weights (which it skips on the meta device, as the replay replays it
    separately); or why the rebuild does not give this model's tensors."""
    cls = _user_class(model)
    draws: list[tuple[str, tuple[int, ...]]] = []
    try:
        with torch.device("meta"), _RecordDraws(draws):
            rebuilt = cls(model.config)
    except Exception as e:  # noqa: BLE001 - any failure means the proof cannot be made
        return f"{cls.__name__}(config) does not rebuild it ({type(e).__name__}: {e})"
    def shapes(m: nn.Module) -> dict[str, tuple[int, ...]]:  # every name, tied or not
        tensors = (*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False))
        return {n: tuple(t.shape) for n, t in tensors}

    if shapes(model) != shapes(rebuilt):
        return f"{cls.__name__}(config) builds other tensors than this model holds (built with other arguments?)"
    return draws


def _check_same_draws(model: nn.Module, eager: list[tuple[str, tuple[int, ...]]] | str, replay: _Replay) -> None:
    """Refuse a transformers model whose eager construction draws the random generator otherwise
    than the replay: every value initialised after the first difference would differ silently."""
    if isinstance(eager, str):
        reason = eager
    elif eager == replay.draws:
        return
    else:
        k = next((i for i, (a, b) in enumerate(zip(eager, replay.draws)) if a != b), min(len(eager), len(replay.draws)))
        near = replay.drawn_by[min(k, len(replay.drawn_by) - 1)] if replay.drawn_by else "<root>"
        reason = (
            f"its construction draws the random generator {len(eager)} times, the replay of its "
            f"init calls {len(replay.draws)} times, first differing at draw {k} (near '{near}'): a "
            "constructor draws random numbers itself or builds a module it then replaces"
        )
    raise ConfigError(
        f"delayed initialisation cannot reproduce {_user_class(model).__name__}'s eager values: {reason}. "
        "Build the model eagerly, or load its pretrained weights instead of relying on init: "
        "smp.transform(model, materialize=False), then smp.checkpointing.load_hf(folder, model) "
        "(docs/checkpoints.md)."
    )


def _user_class(module: nn.Module) -> type:
    """The class the user built: FSDP2's `FSDP<Name>` subclass stripped."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


def _value_owners(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> id(the module whose init calls decide its value).

    Eager construction gives each user of a tied parameter its own tensor and ties them at the
    end: transformers' `tie_weights` points every target at the source of
    `all_tied_weights_keys` ({target: source}), so the source's module owns the value, whichever
    registers it first (T5: `shared`, not `encoder.embed_tokens` or `lm_head`). Outside
    transformers (or for parameters HF does not tie) the first module registering it owns it, as
    in `self.head.weight = self.embed.weight`.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in own_parameters(module).values():
            if param is not None:
                owners.setdefault(id(param), id(module))
    for source in set((getattr(model, "all_tied_weights_keys", None) or {}).values()):
        module_name, _, param_name = source.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue  # a buffer or a name this model no longer has: nothing to own
        param = own_parameters(module).get(param_name)
        if param is not None:
            owners[id(param)] = id(module)
    return owners


def _clear_hf_init_marks(model: nn.Module) -> None:
    """Forget transformers' `_is_hf_initialized` marks: they describe values that were never
    allocated (accelerate's init_empty_weights runs the inits on meta tensors and marks every
    module), and would make the replay skip those modules' inits."""
    clear_initialized_marks((*model.modules(), *model.parameters(), *model.buffers()))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensor_slots(model: nn.Module) -> Iterator[tuple[str, dict, str]]:
    """(qualified name, the module dict holding it, its key there) for every parameter and
    buffer, each tensor once."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for store in (own_parameters(module), own_buffers(module)):
            for name, t in store.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield (f"{module_name}.{name}" if module_name else name), store, name


def _real_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the tensors that are not on meta (accelerate keeps buffers real): `to_empty`
    would otherwise replace them with uninitialised memory."""
    return {
        qualified: _local(store[name]).detach().clone()
        for qualified, store, name in _tensor_slots(model)
        if not _local(store[name]).is_meta
    }


def _unset_marker(t: torch.Tensor):
    """A value no init writes: NaN for floats, the type's minimum for integers (None: bool)."""
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype == torch.bool:
        return None
    return torch.iinfo(t.dtype).min


def _mark_unset(model: nn.Module, real: dict[str, torch.Tensor]) -> None:
    for qualified, store, name in _tensor_slots(model):
        local = _local(store[name])
        if qualified in real:
            local.copy_(real[qualified])
        elif (marker := _unset_marker(local)) is not None:
            local.fill_(marker)


def _check_all_set(model: nn.Module) -> None:
    """Refuse, on every rank alike, a model in which some value was written by no init call."""
    unset = []
    for qualified, store, name in _tensor_slots(model):
        local = _local(store[name])
        marker = _unset_marker(local)
        if marker is None or local.numel() == 0:
            continue
        hit = torch.isnan(local).any() if isinstance(marker, float) else (local == marker).any()
        if bool(hit):
            unset.append(qualified)
    # A rank whose shards happen to be all set must raise too, or the others hang in the next
    # collective: agree on the worst count (the names come from the ranks that saw them).
    count = torch.tensor([len(unset)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        on = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else "cpu"
        count = count.to(on)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count):
        raise ConfigError(
            "delayed initialisation cannot re-create "
            f"{', '.join(unset[:8]) or 'values held by other ranks'}{' ...' if len(unset) > 8 else ''}: "
            "built on the meta device, their values were set in a constructor and no init call "
            "(reset_parameters(), transformers' _init_weights) writes them again. Build the model "
            "eagerly, or keep those tensors real (accelerate's init_empty_weights keeps buffers)."
        )


def _check_initialisable(model: nn.Module) -> None:
    """Outside transformers, only `reset_parameters()` can re-create a module's values."""
    for name, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False)]
        own += [n for n, b in module.named_buffers(recurse=False)]
        if own and not callable(getattr(module, "reset_parameters", None)):
            raise ConfigError(
                f"delayed initialisation cannot initialise module '{name or '<root>'}' "
                f"({type(module).__name__}): it holds {own} but has no reset_parameters(). "
                "Give the class a reset_parameters() that fills them, or build the model eagerly."
            )


@torch.no_grad()
def materialize_meta_model(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a (sharded) meta model on `device` and initialise it like eager construction."""
    hf_model = _is_hf_model(model)
    if not hf_model:
        _check_initialisable(model)
    eager_draws = _eager_construction_draws(model) if hf_model else None  # before seeding: draws nothing real
    _clear_hf_init_marks(model)
    real = _real_values(model)
    model.to_empty(device=device)
    _mark_unset(model, real)
    torch.manual_seed(seed)
    replay = _Replay(model)
    replay.construct(model)
    if hf_model:
        _check_same_draws(model, eager_draws, replay)
        model.tie_weights()
    _check_all_set(model)


def _tied_names(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _holds_whole_ties(stage: nn.Module, ties: list[list[str]]) -> bool:
    """Whether `stage` holds every name of each tied tensor it holds one name of (a tie across
    pipeline stages: each stage keeps its own copy, filled by the replay below)."""
    names = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
    return all(len(names & set(group)) in (0, len(group)) for group in ties)


@torch.no_grad()
def materialize_stages(
    model: nn.Module, stages: list[nn.Module], device: torch.device, seed: int,
    stop_at: frozenset[int] = frozenset(),
) -> None:
    """Allocate and initialise only `stages` (this rank's pipeline stages of `model`, which
    share their parameters' modules with it, possibly sharded already) as eager construction
    of the whole `model` would.

    The replay runs over the whole model in construction order: the other stages' parameters
    (still on meta) get throw-away values on `device` so that the generator is drawn exactly
    as eagerly, one module at a time (the modules of `stop_at`, the decoder layers, bound what
    one init call allocates). The proofs of `materialize_meta_model` apply unchanged: the draw
    sequence of a transformers model is compared with its eager construction's, and a stage
    value no init writes is refused by name. Buffers a stage holds as its own copy (the rotary
    embedding outside the layers) take the value the replay computed for the whole model's.
    """
    hf_model = _is_hf_model(model)
    if not hf_model:
        _check_initialisable(model)
    eager_draws = _eager_construction_draws(model) if hf_model else None
    _clear_hf_init_marks(model)
    ties = _tied_names(model)
    for stage in stages:
        _clear_hf_init_marks(stage)
        real = _real_values(stage)
        stage.to_empty(device=device)
        if hf_model and hasattr(stage, "tie_weights") and _holds_whole_ties(stage, ties):
            stage.tie_weights()  # to_empty gives each name of a tied parameter its own tensor
        _mark_unset(stage, real)
    # Buffers of the whole model still on meta (another stage's, or modules a stage copied):
    # real and unset, so that the inits that compute them (rotary inv_freq) can run.
    for module in model.modules():
        store = own_buffers(module)
        for name, b in store.items():
            if b is not None and b.is_meta:
                store[name] = torch.empty_like(b, device=device)
                if (marker := _unset_marker(store[name])) is not None:
                    store[name].fill_(marker)
    torch.manual_seed(seed)
    replay = _Replay(model, scratch=device, stop_at=stop_at)
    replay.construct(model)
    if hf_model:
        _check_same_draws(model, eager_draws, replay)
    whole = dict(model.named_buffers(remove_duplicate=False))
    for stage in stages:
        for name, b in stage.named_buffers(remove_duplicate=False):
            if name in whole and whole[name] is not b:
                _local(b).copy_(_local(whole[name]))
    for stage in stages:  # one collective per stage: every rank holds as many
        _check_all_set(stage)
