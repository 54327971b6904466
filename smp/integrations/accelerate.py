"""smp under a plain accelerate loop: a script built around `Accelerator` (Hugging Face's
`run_clm_no_trainer.py` and its kind) adds `import smp`, `smp.init()` and
`model = smp.transform(model)` and nothing else.

`smp.init()` opens this module's part of the session when accelerate is imported: it checks
that accelerate sees the same world as torch.distributed (`check_world`), then routes
`Accelerator.prepare` through `_prepare` until `smp.shutdown()` (the one patch, made and undone
through smp._compat). The first `prepare` of each Accelerator in the session adapts that
instance; every change is an instance attribute or one of accelerate's own hooks, removed at
shutdown:

  prepare(model)        an smp model is handed back as it is (accelerate's double-wrap guard):
                        no DDP around DTensor parameters, no autocast (smp's policy casts)
  prepare(dataloader)   accelerate's prepare_data_loader, sharded by data-parallel rank (data.py)
  prepare(optimizer)    accelerate's AcceleratedOptimizer (accumulation skips steps as usual),
                        kept out of accelerate's own checkpoint list: smp saves it, sharded
  prepare(scheduler)    AcceleratedScheduler, stepped once per data-parallel rank per update
                        (accelerate: once per process) so that TP / PP ranks do not count twice
  no_sync / accumulate  smp.no_sync for smp models
  clip_grad_norm_       smp.clip_grad_norm_ (the global norm over shards and TP ranks)
  gather(_for_metrics), reduce   over the data-parallel ranks when other ranks share their rows
  get_state_dict        the whole model as host tensors (saving.full_state_dict)
  save_state/load_state register_save_state_pre_hook / register_load_state_pre_hook: the model
                        and its optimizer through smp.checkpointing.save / load (sharded, any
                        layout on load) into `<dir>/smp_model`; accelerate keeps RNG, scheduler,
                        data loader and registered objects
  model.save_pretrained (what `unwrap_model(model)` returns) smp's export into the folder, also
                        an output_dir holding other files (saving.export_hf_folder)

Refused with the fix, on every rank, before any collective of the step: an Accelerator that
decided "one process" in a world of several (`ACCELERATE_USE_CPU=1` / `Accelerator(cpu=True)`),
accelerate's mixed precision (smp's `mixed_precision` config does it), an optimizer of an smp
model that did not go through `prepare`, a gradient clip over part of an smp model's parameters.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState
from accelerate.state import is_initialized as accelerate_initialized
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, RandomSampler

from smp import _compat, checkpointing, runtime
from smp.errors import CheckpointError, ConfigError
from smp.integrations.data import gather_by_dp, gather_for_metrics_by_dp, prepare_data_loader_by_dp, reduce_by_dp
from smp.integrations.saving import export_hf_folder, full_state_dict
from smp.pipeline.schedule import PipelinedModel
from smp.scope import Slot
from smp.training import clip_grad_norm_, no_sync
from smp.transform import is_transformed

log = logging.getLogger(__name__)

# The folder of model i's smp checkpoint inside an `accelerator.save_state` folder.
MODEL_DIR = "smp_model"
# Instance attributes an adapted Accelerator gets (removed at shutdown).
_OVERRIDES = ("prepare_data_loader", "prepare_optimizer", "prepare_scheduler", "no_sync", "clip_grad_norm_",
              "get_state_dict", "gather", "gather_for_metrics", "reduce")


def model_dir(index: int) -> str:
    return MODEL_DIR if index == 0 else f"{MODEL_DIR}_{index}"


def is_smp_model(obj: Any) -> bool:
    return isinstance(obj, PipelinedModel) or (isinstance(obj, nn.Module) and is_transformed(obj))


# ------------------------------------------------------------------------------------------------
# The session's part: what smp.init opens and smp.shutdown closes


@dataclass
class _Adapted:
    """One Accelerator as this session adapted it."""

    accelerator: Accelerator
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)  # of smp models, saved by smp
    models: list[nn.Module] = field(default_factory=list)  # smp models that went through prepare
    handles: list[Any] = field(default_factory=list)  # accelerate's hook handles
    warned_scheduler: bool = False
    order_at_iteration: bool = False  # a loader shuffles from the process generator when iteration starts

    def restore(self) -> None:
        for handle in self.handles:
            handle.remove()
        for name in _OVERRIDES:
            self.accelerator.__dict__.pop(name, None)
        for model in self.models:
            model.__dict__.pop("save_pretrained", None)


class _Session:
    def __init__(self) -> None:
        self.undo_patch: Callable[[], None] | None = None
        self.adapted: dict[int, _Adapted] = {}

    def close(self) -> None:
        for adapted in self.adapted.values():
            adapted.restore()
        self.adapted.clear()
        if self.undo_patch is not None:
            self.undo_patch()


_SESSION: Slot[_Session] = Slot("accelerate integration", make=_Session, close=_Session.close)


def start(world_size: int) -> None:
    """(smp.init) Check accelerate's world, then route `Accelerator.prepare` through smp until
    shutdown."""
    check_world(world_size)
    session = _SESSION.get()
    if session.undo_patch is None:
        session.undo_patch = _compat.wrap_accelerator_prepare(_prepare)


def check_world(world_size: int, num_processes: int | None = None) -> None:
    """Refuse an Accelerator that runs this process as a one-process run while the launch has
    `world_size` processes (accelerate under torchrun on CPU without ACCELERATE_USE_CPU: every
    rank would read every row, believe it is rank 0 and write the output files)."""
    if num_processes is None:  # at smp.init: an Accelerator the script built before
        if not accelerate_initialized() or AcceleratorState().num_processes != 1:
            return  # (a state of several processes is checked against the world at its first prepare)
        num_processes = 1
    if num_processes != world_size:
        raise ConfigError(
            f"accelerate runs this process as one of {num_processes} (its distributed type is "
            f"{AcceleratorState().distributed_type.value}), but the launch started {world_size} processes. On CPU "
            f"accelerate joins the other processes only when told to: set ACCELERATE_USE_CPU=1 in the environment "
            f"(torchrun / accelerate launch) or build Accelerator(cpu=True). On GPUs, check that every process "
            f"sees its device (CUDA_VISIBLE_DEVICES)."
        )


def _prepare(original: Callable[..., Any], accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
    """`Accelerator.prepare` in an smp session: adapt the accelerator on its first call, mark
    smp models as prepared (handed back as they are), then accelerate's own prepare."""
    adapted = _adapt(accelerator)
    if adapted is not None:
        for obj in args:
            if is_smp_model(obj):
                _adopt_model(adapted, obj)
    return original(accelerator, *args, **kwargs)


def _adapt(accelerator: Accelerator) -> _Adapted | None:
    session = _SESSION.get()
    adapted = session.adapted.get(id(accelerator))
    if adapted is not None or _adapted_by_trainer(accelerator):
        return adapted
    st = runtime.state
    check_world(st.world_size, accelerator.num_processes)
    if accelerator.mixed_precision not in ("no", None):
        raise ConfigError(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) (or accelerate launch --mixed_precision) "
            f"casts through autocast around a DDP model; smp shards the model and casts it itself. Leave accelerate's "
            f"mixed precision off and set mixed_precision: {{param_dtype: {accelerator.mixed_precision}}} in the smp "
            f"config"
        )
    adapted = _Adapted(accelerator)
    session.adapted[id(accelerator)] = adapted
    peers = st.dp_size < st.world_size  # TP / CP / PP ranks read the rows of their dp rank
    overrides: dict[str, Any] = {
        "prepare_data_loader": functools.partial(_prepare_data_loader, adapted, peers=peers),
        "prepare_optimizer": functools.partial(_prepare_optimizer, adapted, accelerator.prepare_optimizer),
        "prepare_scheduler": functools.partial(_prepare_scheduler, adapted),
        "no_sync": functools.partial(_no_sync, accelerator.no_sync),
        "clip_grad_norm_": functools.partial(_clip_grad_norm, adapted, accelerator.clip_grad_norm_),
        "get_state_dict": functools.partial(_get_state_dict, accelerator.get_state_dict),
    }
    if peers:
        group = st.dp_mesh.get_group()
        overrides["gather"] = functools.partial(gather_by_dp, group=group)
        overrides["gather_for_metrics"] = functools.partial(gather_for_metrics_by_dp, accelerator, group=group)
        overrides["reduce"] = functools.partial(reduce_by_dp, group=group)
    for name, value in overrides.items():
        setattr(accelerator, name, value)
    adapted.handles.append(accelerator.register_save_state_pre_hook(functools.partial(_save_state_hook, adapted)))
    adapted.handles.append(accelerator.register_load_state_pre_hook(functools.partial(_load_state_hook, adapted)))
    return adapted


def _adapted_by_trainer(accelerator: Accelerator) -> bool:
    """smp's Trainer integration adapts its own accelerator (and saves through the Trainer)."""
    loader = accelerator.__dict__.get("prepare_data_loader")
    return isinstance(loader, functools.partial) and loader.func is prepare_data_loader_by_dp


def _adopt_model(adapted: _Adapted, model: nn.Module) -> None:
    _compat.mark_prepared(model)  # accelerate's prepare_model hands it back (and lists it in _models)
    if model in adapted.models:
        return
    adapted.models.append(model)
    # `unwrap_model(model)` is the model itself: its save_pretrained exports the sharded model
    # (transformers' own, kept for a given whole state_dict; a pipelined model has none).
    own = getattr(type(model), "save_pretrained", None)
    model.save_pretrained = functools.partial(_save_pretrained, model, None if own is None else own.__get__(model))


# ------------------------------------------------------------------------------------------------
# prepare: data loaders, optimizer and scheduler


def _prepare_data_loader(adapted: _Adapted, data_loader: DataLoader, device_placement: bool | None = None, *,
                         peers: bool, **kwargs: Any) -> DataLoader:
    st, accelerator = runtime.state, adapted.accelerator
    if (st.dp_size == 1 and isinstance(getattr(data_loader, "sampler", None), RandomSampler)
            and not accelerator.use_seedable_sampler):
        adapted.order_at_iteration = True  # (see _load_state_hook)
    return prepare_data_loader_by_dp(accelerator, data_loader, dp_rank=st.dp_rank, dp_size=st.dp_size,
                                     device_placement=device_placement, peers=peers, **kwargs)



def _param_ids(modules: list[nn.Module]) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _prepare_optimizer(adapted: _Adapted, original: Callable[..., Any], optimizer: torch.optim.Optimizer,
                       device_placement: bool | None = None) -> Any:
    if _compat.is_prepared(optimizer) or optimizer in adapted.optimizers:
        return optimizer
    params = _optimizer_params(optimizer)
    ours = _param_ids(adapted.models)
    held = [id(p) in ours for p in params]
    if not any(held):
        if any(isinstance(p, DTensor) for p in params):
            raise ConfigError(
                "accelerator.prepare got an optimizer over smp-sharded parameters without their model: pass the "
                "model to accelerator.prepare too (before or together with its optimizer), e.g. "
                "model, optimizer, ... = accelerator.prepare(model, optimizer, ...). accelerator.save_state saves an "
                "smp model (sharded) only when it went through prepare; without it the checkpoint has no weights"
            )
        return original(optimizer, device_placement=device_placement)
    if not all(held):
        raise ConfigError(
            "accelerator.prepare got an optimizer over parameters of an smp model and of other modules; smp saves "
            "and loads an optimizer with its model: build one optimizer per model"
        )
    # No device placement (smp placed every shard); no scaler (smp's mixed precision has none).
    wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=None)
    _compat.mark_prepared(wrapped)
    adapted.optimizers.append(wrapped)
    return wrapped


class DataParallelScheduler(AcceleratedScheduler):
    """accelerate's AcceleratedScheduler, stepped `steps_per_update` times per optimizer update
    (the number of data-parallel ranks) where accelerate steps it once per process: a script
    sizes its schedule in batches of one process (accelerate's convention), and under smp a batch
    is shared by the TP / CP / PP ranks of one data-parallel rank."""

    def __init__(self, scheduler: Any, optimizers: Any, *, step_with_optimizer: bool, split_batches: bool,
                 steps_per_update: int) -> None:
        super().__init__(scheduler, optimizers, step_with_optimizer=step_with_optimizer, split_batches=split_batches)
        self.steps_per_update = steps_per_update

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer or self.split_batches or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)  # accelerate's own (one step, or none while accumulating)
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.steps_per_update):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR stops at its end
            if total is None or _compat.scheduler_step_count(self.scheduler) <= total:
                self.scheduler.step(*args, **kwargs)


def _prepare_scheduler(adapted: _Adapted, scheduler: Any) -> Any:
    accelerator = adapted.accelerator
    if _compat.is_prepared(scheduler):
        return scheduler
    candidates = adapted.optimizers + _compat.prepared_optimizers(accelerator)
    optimizer = next((o for o in candidates if getattr(scheduler, "optimizer", None) is o.optimizer), candidates)
    st = runtime.state
    wrapped = DataParallelScheduler(scheduler, optimizer, step_with_optimizer=accelerator.step_scheduler_with_optimizer,
                                    split_batches=accelerator.split_batches, steps_per_update=st.dp_size)
    _compat.track_scheduler(accelerator, wrapped)
    if st.dp_size < st.world_size and not adapted.warned_scheduler and st.rank == 0:
        adapted.warned_scheduler = True
        log.warning(
            "smp: the learning-rate scheduler steps %d time(s) per update, once per data-parallel rank "
            "(runtime.state.dp_size); accelerator.num_processes is %d (every process). A schedule length or warmup "
            "your script multiplied by accelerator.num_processes is %dx too long here: multiply by "
            "runtime.state.dp_size instead", st.dp_size, st.world_size, st.world_size // st.dp_size)
    return wrapped


# ------------------------------------------------------------------------------------------------
# Gradients


@contextlib.contextmanager
def _no_sync(original: Callable[[nn.Module], Any], model: nn.Module) -> Iterator[None]:
    with (no_sync(model) if is_smp_model(model) else original(model)):
        yield


def _clip_grad_norm(adapted: _Adapted, original: Callable[..., Any], parameters: Any, max_norm: float,
                    norm_type: float = 2) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    ours = _param_ids(adapted.models)
    held = [id(p) in ours for p in params]
    if not any(held):
        return original(params, max_norm, norm_type)
    if not all(held):
        raise ConfigError(
            "accelerator.clip_grad_norm_ got parameters of an smp model mixed with others; the global norm is "
            "taken per model: clip each model's parameters in its own call (accelerator.clip_grad_norm_(model.parameters(), ...))"
        )
    wanted = {id(p) for p in params}
    for model in adapted.models:  # the whole model: a pipelined one sums its stages over pipeline ranks
        if _param_ids([model]) == wanted:
            return clip_grad_norm_(model, max_norm, norm_type)
    return clip_grad_norm_(params, max_norm, norm_type)


# ------------------------------------------------------------------------------------------------
# Saving


def _get_state_dict(original: Callable[..., Any], model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
    # unwrap=False (accelerate's save_state asks so) is the model's own, sharded state dict.
    if is_smp_model(model) and unwrap:
        return full_state_dict(model)
    return original(model, unwrap=unwrap)


def _save_pretrained(model: nn.Module, original: Callable[..., Any] | None, save_directory: str | os.PathLike,
                     is_main_process: bool = True, state_dict: dict | None = None, save_function: Any = None,
                     push_to_hub: bool = False, max_shard_size: int | str | None = None, **kwargs: Any) -> None:
    """`model.save_pretrained` of an smp model: every rank calls it (as accelerate scripts do,
    with `is_main_process=accelerator.is_main_process`); rank 0 writes. A given `state_dict`
    (`accelerator.get_state_dict(model)`, whole) is written by transformers' own save_pretrained."""
    if state_dict is not None and original is not None:
        return original(save_directory, is_main_process=is_main_process, state_dict=state_dict,
                        save_function=save_function, push_to_hub=push_to_hub,
                        **({} if max_shard_size is None else {"max_shard_size": max_shard_size}), **kwargs)
    unsupported = [k for k in ("variant",) if kwargs.get(k)] + (
        ["safe_serialization=False"] if kwargs.get("safe_serialization") is False else [])
    if push_to_hub or unsupported:
        raise ConfigError(
            f"save_pretrained of an smp model writes a local folder (safetensors, config); "
            f"{'push_to_hub' if push_to_hub else ', '.join(unsupported)} is not supported: save, then upload the "
            f"folder (huggingface_hub.upload_folder)"
        )
    export_hf_folder(save_directory, model, max_shard_bytes=_shard_bytes(max_shard_size))


def _shard_bytes(max_shard_size: int | str | None) -> int:
    from smp.checkpointing.hf import DEFAULT_MAX_SHARD_BYTES

    if max_shard_size is None:
        return DEFAULT_MAX_SHARD_BYTES
    if isinstance(max_shard_size, int):
        return max_shard_size
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(max_shard_size)


def _optimizer_of(adapted: _Adapted, model: nn.Module) -> torch.optim.Optimizer | None:
    ids = _param_ids([model])
    mine = [o for o in adapted.optimizers if all(id(p) in ids for p in _optimizer_params(o.optimizer))]
    if len(mine) > 1:
        raise ConfigError(
            f"accelerator.save_state: {len(mine)} optimizers hold parameters of one smp model; smp checkpoints one "
            f"optimizer per model: build one optimizer (with parameter groups) for it"
        )
    return mine[0].optimizer if mine else None


def _save_state_hook(adapted: _Adapted, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
    """accelerate's save pre-hook: each smp model with its optimizer as an smp checkpoint in
    `<output_dir>/smp_model[_i]`, its entry taken out of the weights accelerate writes."""
    with_model = {id(_optimizer_of(adapted, m)) for m in models if is_smp_model(m)}
    if any(id(o.optimizer) not in with_model for o in adapted.optimizers):  # its model left the list (free_memory)
        raise ConfigError(
            "accelerator.save_state: an optimizer of an smp model is prepared but its model is not among the "
            "accelerator's models; prepare the model again with accelerator.prepare(model)"
        )
    for i in reversed(range(len(models))):
        if not is_smp_model(models[i]):
            continue
        checkpointing.save(os.path.join(output_dir, model_dir(i)), models[i], _optimizer_of(adapted, models[i]))
        if i < len(weights):
            del weights[i]


def _load_state_hook(adapted: _Adapted, models: list[nn.Module], input_dir: str) -> None:
    """accelerate's load pre-hook: each smp model and its optimizer from `<input_dir>/smp_model[_i]`
    (at any layout: smp reshards), taken out of the models accelerate loads."""
    if adapted.order_at_iteration and runtime.state.rank == 0:
        log.warning(
            "smp: one data-parallel rank reads the data as accelerate's one-process loader does: a shuffling loader "
            "draws each epoch's order when iteration starts, so after load_state a resumed epoch is read in another "
            "order than the interrupted run's (accelerate in one process does the same). For an exact resume build "
            "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))")
    for i in reversed(range(len(models))):
        if not is_smp_model(models[i]):
            continue
        path = os.path.join(input_dir, model_dir(i))
        try:
            checkpointing.load(path, models[i], _optimizer_of(adapted, models[i]))
        except CheckpointError as e:
            raise CheckpointError(
                f"accelerator.load_state({input_dir!r}): model {i} is an smp model, whose weights and optimizer "
                f"accelerator.save_state writes to {model_dir(i)}/ as an smp checkpoint; loading it failed: {e}. "
                f"A folder saved without smp holds model.safetensors instead: load those weights with "
                f"smp.checkpointing.load_hf(folder, model)"
            ) from e
        del models[i]
