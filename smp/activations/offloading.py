"""Activation offloading: saved activations go to host memory in forward, come back in backward.

One `ActivationOffloader` serves all blocks. While block i runs forward, a
`saved_tensors_hooks` context copies each tensor autograd saves (not parameters, not tensors
under `activation_offload_min_bytes`) to host memory and lets the device copy go. With
checkpointing on, the only tensors a checkpointed block saves are its inputs (torch's
checkpoint saves them under our hooks, outside its own), so those are what move.

In backward, when the gradient reaches block i's output, the offloader brings back block i
and the next `activation_loading_horizon - 1` blocks below it, so at most `horizon` blocks'
activations are on the device at once and the copies for the next blocks overlap this
block's compute. On CUDA the copies use pinned host buffers, two side streams and events; on
CPU the same code path runs with plain copies (the "host" store is separate tensors, counted
in `OffloadStats`), which is how CI proves the scheduling and the gradients.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks

from smp._compat import dtensor_from_spec, dtensor_local, dtensor_spec, in_backward, tree_leaves, version_counter
from smp.errors import ConfigError


def _needs_grad(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether backward can run through `module` for this call: a parameter or an input tensor
    requires a gradient, and autograd is recording."""
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs)))


def apply_activation_offloading(model: nn.Module, blocks: list[nn.Module], *, horizon: int, min_bytes: int) -> None:
    """Install an offloader on `blocks` (in forward order); `offload_stats(model)` reads it.

    `horizon`: how many blocks' activations come back ahead of backward; `min_bytes`: smaller
    saved tensors stay on the device (the config's `activation_loading_horizon` and
    `activation_offload_min_bytes`).
    """
    if not blocks:
        raise ConfigError(
            f"activation_offloading found no blocks in {type(model).__name__} to offload; "
            "name the block class in shard_modules"
        )
    offloader = ActivationOffloader(blocks, horizon=horizon, min_bytes=min_bytes)
    offloader.attach()
    # A plain attribute (not a submodule, not state): invisible to state_dict and FSDP.
    object.__setattr__(model, "_smp_activation_offloader", offloader)


def offload_stats(model: nn.Module) -> OffloadStats | None:
    offloader = getattr(model, "_smp_activation_offloader", None)
    return None if offloader is None else offloader.stats


@dataclass
class OffloadStats:
    """What the offloader did, per block (forward order) and in total.

    `saved_bytes[i]`: bytes autograd saved in block i's last forward (each tensor once,
    parameters excluded); `offloaded_bytes[i]`: the part moved to host; the rest stayed on the
    device. `max_layers_resident`: the most blocks whose offloaded activations were on the
    device at once during backward since the last `reset()`.
    """

    layers: int
    saved_bytes: list[int] = field(default_factory=list)
    offloaded_bytes: list[int] = field(default_factory=list)
    max_layers_resident: int = 0
    prefetch_loads: int = 0  # tensors brought back ahead of need (by the horizon schedule)
    demand_loads: int = 0  # tensors brought back only when backward asked for them

    def __post_init__(self) -> None:
        self.saved_bytes = self.saved_bytes or [0] * self.layers
        self.offloaded_bytes = self.offloaded_bytes or [0] * self.layers

    @property
    def resident_bytes(self) -> list[int]:
        return [s - o for s, o in zip(self.saved_bytes, self.offloaded_bytes)]

    @property
    def total_saved_bytes(self) -> int:
        return sum(self.saved_bytes)

    @property
    def total_offloaded_bytes(self) -> int:
        return sum(self.offloaded_bytes)

    def reset(self) -> None:
        self.max_layers_resident = self.prefetch_loads = self.demand_loads = 0


class _Handle:
    """One offloaded tensor: its host copy, and its device copy while it is loaded."""

    __slots__ = ("layer", "host", "origin", "device", "spec", "pending", "d2h_done", "h2d_done", "__weakref__")

    def __init__(self, layer: int, host: torch.Tensor, origin: torch.device, spec, d2h_done) -> None:
        self.layer, self.host, self.origin, self.spec, self.d2h_done = layer, host, origin, spec, d2h_done
        self.device: torch.Tensor | None = None
        self.h2d_done = None
        self.pending = 1  # unpacks still to come (a tensor saved twice is packed twice)


class _Kept:
    """A saved tensor that stays on the device (parameter, small, or not ours to move)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationOffloader:
    def __init__(self, blocks: list[nn.Module], horizon: int, min_bytes: int) -> None:
        self.blocks = list(blocks)
        self.horizon = horizon
        self.min_bytes = min_bytes
        self.stats = OffloadStats(layers=len(self.blocks))
        # Handles not yet unpacked, per block. Weak: a graph freed without backward frees them.
        self._outstanding: list[weakref.WeakSet[_Handle]] = [weakref.WeakSet() for _ in self.blocks]
        self._resident: set[int] = set()
        self._contexts: dict[int, saved_tensors_hooks] = {}
        # This block's forward only: key -> (packed, tensor). Holding the tensor until the block
        # ends keeps its address from being reused by a new tensor that would match the key.
        self._dedup: dict[tuple, tuple[_Handle | _Kept, torch.Tensor]] = {}
        self._param_ptrs: set[int] = set()
        self._streams = None  # (d2h, h2d) CUDA streams, made on first CUDA tensor
        self._host_bytes = [0]  # bytes in host copies alive now (shared with their finalizers)

    # ------------------------------------------------------------------ installation
    def attach(self) -> None:
        for index, block in enumerate(self.blocks):
            # prepend: our context must be open before checkpoint's pre-hook saves the inputs.
            block.register_forward_pre_hook(functools.partial(self._pre_forward, index), prepend=True, with_kwargs=True)
            block.register_forward_hook(functools.partial(self._post_forward, index), always_call=True)

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, index: int, module: nn.Module, args, kwargs) -> None:
        if in_backward():  # checkpoint's recompute: its own hooks own the saved tensors
            return
        if not _needs_grad(module, args, kwargs):
            # A frozen block on inputs that need no gradient (a frozen vision tower): backward
            # never runs through it, so nothing it might save is worth moving to the host.
            self.stats.saved_bytes[index] = self.stats.offloaded_bytes[index] = 0
            return
        self._param_ptrs = {_storage_ptr(p) for p in module.parameters()}
        self._dedup = {}
        self.stats.saved_bytes[index] = self.stats.offloaded_bytes[index] = 0
        ctx = saved_tensors_hooks(functools.partial(self._pack, index), self._unpack)
        ctx.__enter__()
        self._contexts[index] = ctx

    def _post_forward(self, index: int, module: nn.Module, args, output) -> None:
        ctx = self._contexts.pop(index, None)
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        self._dedup = {}
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            # Fires when backward reaches this block: time to bring it (and the next) back.
            register_multi_grad_hook(outputs, functools.partial(self._on_backward, index), mode="any")

    def _pack(self, index: int, tensor: torch.Tensor):
        key = _tensor_key(tensor)
        previous = self._dedup.get(key)
        if previous is not None:  # the same tensor saved again (q, k and v share one input)
            packed = previous[0]
            if isinstance(packed, _Handle):
                packed.pending += 1
            return packed
        if isinstance(tensor, nn.Parameter) or _storage_ptr(tensor) in self._param_ptrs:
            return _Kept(tensor)  # parameters (and views of them) are not activations
        nbytes = tensor.numel() * tensor.element_size()
        local = dtensor_local(tensor)
        keep = (
            type(local) is not torch.Tensor  # other subclasses (fp8, ...) keep their own rules
            or nbytes < self.min_bytes
            or local.device.type == "meta"
            or (local.device.type != "cpu" and not local.is_cuda)
        )
        self.stats.saved_bytes[index] += nbytes
        if keep:
            packed = _Kept(tensor)
        else:
            self.stats.offloaded_bytes[index] += nbytes
            spec = dtensor_spec(tensor)
            packed = self._to_host(index, local, spec)
            self._outstanding[index].add(packed)
        self._dedup[key] = (packed, tensor)
        return packed

    def _to_host(self, index: int, tensor: torch.Tensor, spec) -> _Handle:
        handle = self._copy_to_host(index, tensor, spec)
        nbytes = handle.host.numel() * handle.host.element_size()
        self._host_bytes[0] += nbytes
        weakref.finalize(handle, _release, self._host_bytes, nbytes)
        return handle

    def host_bytes(self) -> int:
        """Bytes held in host copies right now."""
        return self._host_bytes[0]

    def _copy_to_host(self, index: int, tensor: torch.Tensor, spec) -> _Handle:
        if not tensor.is_cuda:
            # CPU: the "host" copy is a separate tensor; the original is released by autograd.
            return _Handle(index, torch.empty_like(tensor).copy_(tensor), tensor.device, spec, None)
        d2h, _ = self._cuda_streams()
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream())  # the tensor must be fully written first
        with torch.cuda.stream(d2h):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        tensor.record_stream(d2h)  # its memory is not reused until the copy has read it
        return _Handle(index, host, tensor.device, spec, done)

    # ------------------------------------------------------------------ backward
    def _on_backward(self, index: int, _grads) -> None:
        # Blocks above whose activations are all consumed no longer count as resident.
        for layer in [j for j in self._resident if j > index and not self._outstanding[j]]:
            self._resident.discard(layer)
        for layer in range(index, max(index - self.horizon, -1), -1):
            self._load_layer(layer, prefetch=True)

    def _load_layer(self, layer: int, prefetch: bool) -> None:
        handles = [h for h in self._outstanding[layer] if h.device is None]
        if not handles:
            return
        for handle in handles:
            self._load(handle)
        if prefetch:
            self.stats.prefetch_loads += len(handles)
        self._resident.add(layer)
        self.stats.max_layers_resident = max(self.stats.max_layers_resident, len(self._resident))

    def _load(self, handle: _Handle) -> None:
        host = handle.host
        if handle.d2h_done is None:  # CPU path: a plain copy back
            handle.device = torch.empty_like(host).copy_(host)
            return
        _, h2d = self._cuda_streams()
        with torch.cuda.stream(h2d):
            h2d.wait_event(handle.d2h_done)
            handle.device = host.to(handle.origin, non_blocking=True)
            handle.h2d_done = torch.cuda.Event()
            handle.h2d_done.record()

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        handle: _Handle = packed
        if handle.device is None:  # not prefetched (horizon missed it, or a second backward)
            self.stats.demand_loads += 1
            self._load(handle)
            self._resident.add(handle.layer)
            self.stats.max_layers_resident = max(self.stats.max_layers_resident, len(self._resident))
        tensor = handle.device
        if handle.h2d_done is not None:
            torch.cuda.current_stream().wait_event(handle.h2d_done)
            tensor.record_stream(torch.cuda.current_stream())  # allocated on h2d, used here
        handle.pending -= 1
        if handle.pending <= 0:
            # Last use: autograd now holds the only device reference and frees it after use.
            handle.device, handle.h2d_done = None, None
            self._outstanding[handle.layer].discard(handle)
            if not self._outstanding[handle.layer]:
                self._resident.discard(handle.layer)
        if handle.spec is not None:
            return dtensor_from_spec(tensor, handle.spec, requires_grad=False)
        return tensor

    def _cuda_streams(self):
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def host_storage_ptrs(self) -> set[int]:
        """Storages of the host copies now held (so memory meters can leave them out)."""
        return {_storage_ptr(h.host) for s in self._outstanding for h in s}


def _release(counter: list[int], nbytes: int) -> None:
    counter[0] -= nbytes


def _storage_ptr(t: torch.Tensor) -> int:
    t = dtensor_local(t)
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return -1


def _tensor_key(t: torch.Tensor) -> tuple:
    """Equal for two views with the same storage, offset, shape and strides: F.linear on a 3-D
    input saves a fresh 2-D view per call, so q, k and v projections save three of them."""
    local = dtensor_local(t)
    try:
        return (_storage_ptr(local), local.storage_offset(), tuple(local.shape), tuple(local.stride()),
                local.dtype, version_counter(local), id(type(t)))
    except (RuntimeError, NotImplementedError):  # no storage: the object itself (held while keyed)
        return ("object", id(t))
