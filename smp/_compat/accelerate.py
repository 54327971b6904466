"""accelerate's private names smp reaches (checked on 1.15)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


from smp._compat.versions import unsupported

# ----------------------------------------------------------------------------------------------
# accelerate (checked 1.15)
# ----------------------------------------------------------------------------------------------


def is_prepared(obj: Any) -> bool:
    """True when accelerate's `prepare` already handled `obj` (`_is_accelerate_prepared`)."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def mark_prepared(obj: Any) -> None:
    """Make accelerate's `prepare` hand `obj` back as it is (`_is_accelerate_prepared`)."""
    obj._is_accelerate_prepared = True


def track_dataloader(accelerator: Any, data_loader: Any) -> None:
    """Register a data loader the way `Accelerator.prepare_data_loader` does, so that
    `free_memory()` drops it: append to `Accelerator._dataloaders`."""
    loaders = getattr(accelerator, "_dataloaders", None)
    if not isinstance(loaders, list):
        raise unsupported("preparing data loaders sharded over the data-parallel ranks", "accelerate")
    loaders.append(data_loader)


def track_scheduler(accelerator: Any, scheduler: Any) -> None:
    """Register a wrapped scheduler the way `Accelerator.prepare_scheduler` does, so that
    `save_state` / `load_state` carry its state: append to `Accelerator._schedulers`."""
    schedulers = getattr(accelerator, "_schedulers", None)
    if not isinstance(schedulers, list):
        raise unsupported("preparing learning-rate schedulers for smp's data-parallel ranks", "accelerate")
    schedulers.append(scheduler)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The optimizers accelerate prepared itself (`Accelerator._optimizers`)."""
    return list(getattr(accelerator, "_optimizers", None) or [])


def scheduler_step_count(scheduler: Any) -> int:
    """How often a torch LR scheduler has stepped (`LRScheduler._step_count`; accelerate reads it
    too, to stop a OneCycleLR at its `total_steps`)."""
    return scheduler._step_count


def wrap_accelerator_prepare(wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Route `Accelerator.prepare` (every instance) through `wrapper(original, accelerator, *args,
    **kwargs)`; returns the function that puts the original back. smp's session installs it at
    `smp.init` and undoes it at `smp.shutdown` (accelerate has no hook for an outside
    parallelism backend: its ParallelismConfig would apply its own FSDP / TP)."""
    from accelerate import Accelerator

    original = Accelerator.__dict__["prepare"]

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapper(original, self, *args, **kwargs)

    prepare.__wrapped__ = original  # type: ignore[attr-defined]
    prepare.__doc__ = original.__doc__
    Accelerator.prepare = prepare

    def undo() -> None:
        if Accelerator.__dict__.get("prepare") is prepare:
            Accelerator.prepare = original

    return undo
