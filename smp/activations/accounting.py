"""Measuring activation memory and recompute, the same way for every mode, on any device.

`SavedActivationMeter` answers "how many bytes does backward keep alive after forward?"
without an allocator: it watches every tensor an op creates during forward (a
TorchDispatchMode) and, after forward, sums the storages still alive. That covers what
autograd saved, what selective checkpointing cached, checkpoint inputs, and the device copies
an offloader did not move, so none / full / selective / offload compare on one scale, on CPU.

`OpCounter` counts aten ops while it is active. Run it around `loss.backward()`: ops like
`aten.mm` that run there beyond the backward formulas' own are recompute (forward hooks cannot
show this: non-reentrant recompute skips module hooks and stops early).
"""

from __future__ import annotations

import collections
import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from smp._compat import TorchDispatchMode, dtensor_local, op_name, tree_leaves


@dataclass
class ActivationBytes:
    per_layer: list[int]  # bytes alive after forward, created inside block i
    other: int  # created outside the blocks (embeddings, head, loss)

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.other


class SavedActivationMeter(TorchDispatchMode):
    """Use as `with SavedActivationMeter(blocks) as meter: loss = model(...)`, then
    `meter.live_bytes(exclude=...)` before backward.

    Kept open through backward too, `peak_bytes` is the most bytes that tensors created under
    the meter held at once (activations, recompute, gradients, temporaries): the CPU stand-in
    for CUDA's peak allocated memory. `host_bytes()` (an offloader's) is subtracted, so host
    copies do not count as device memory.
    """

    def __init__(self, blocks: list[nn.Module] = (), host_bytes=lambda: 0) -> None:
        super().__init__()
        self.blocks = list(blocks)
        self.host_bytes = host_bytes
        self._layer: int | None = None
        self._records: dict[int, tuple[weakref.ref, int, int | None]] = {}
        self._hooks: list = []
        self.current_bytes = 0
        self.peak_bytes = 0

    def __enter__(self):
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(functools.partial(self._enter_block, index)))
            self._hooks.append(block.register_forward_hook(self._leave_block, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _enter_block(self, index: int, module, args) -> None:
        self._layer = index

    def _leave_block(self, module, args, output) -> None:
        self._layer = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._record(t)
        return out

    def _record(self, t: torch.Tensor) -> None:
        t = dtensor_local(t)
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # subclasses / storage-less tensors
            return
        if ptr == 0:
            return
        known = self._records.get(ptr)
        if known is not None and known[0]() is storage:
            return  # a view of a storage already counted
        nbytes = storage.nbytes()
        self._records[ptr] = (weakref.ref(storage, functools.partial(self._freed, nbytes)), nbytes, self._layer)
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes - self.host_bytes())

    def _freed(self, nbytes: int, _ref) -> None:
        self.current_bytes -= nbytes

    def live_bytes(self, exclude: set[int] = frozenset()) -> ActivationBytes:
        """Bytes of storages created in forward and alive now, minus the `exclude` data_ptrs."""
        per_layer, other = [0] * len(self.blocks), 0
        for ptr, (ref, nbytes, layer) in self._records.items():
            if ref() is None or ptr in exclude:
                continue
            if layer is None:
                other += nbytes
            else:
                per_layer[layer] += nbytes
        return ActivationBytes(per_layer, other)


def parameter_ptrs(model: nn.Module) -> set[int]:
    """Storages of the model's parameters and gradients (not activations)."""
    ptrs = set()
    for p in model.parameters():
        for t in (p, p.grad):
            if t is None:
                continue
            t = dtensor_local(t)
            ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


class OpCounter(TorchDispatchMode):
    """Counts ops by name ("aten.mm") while active: `counter.counts["aten.mm"]`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[op_name(func).replace("::", ".")] += 1
        return func(*args, **(kwargs or {}))
