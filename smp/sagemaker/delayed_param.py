"""`DelayedParamIniter`: SMP v2's delayed parameter initialisation, on smp's (meta-device model,
materialised shard by shard, values equal to eager construction for the same seed).

SMP scripts build the model on the meta device, then hand `get_param_init_fn()` to FSDP1. With
smp, `transform` shards and materialises the meta model itself, so the FSDP1 call goes and the
initer's validation context wraps `transform` instead:

    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = tsm.transform(model)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch
from torch import nn

import smp
from smp._compat import own_buffers, own_parameters
from smp.sharding import has_meta_tensors, materialize_meta_model

log = logging.getLogger(__name__)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*own_parameters(module).values(), *own_buffers(module).values()) if t is not None]


class DelayedParamIniter:
    def __init__(
        self,
        model: nn.Module,
        init_method_using_config: Callable[[nn.Module], None] | None = None,
        verbose: bool = False,
    ) -> None:
        """`init_method_using_config(module)`: your per-module init (it allocates and fills the
        module's own tensors); None replays the model's own initialisation (reset_parameters(),
        transformers' _init_weights), bitwise equal to building it eagerly."""
        self.model = model
        self.init_method_using_config = init_method_using_config
        self.verbose = verbose
        self.num_params_inited = 0

    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """fn(module): materialise `module` if it still holds meta tensors (a no-op after
        smp.sagemaker.transform, which materialises the model it shards)."""

        def param_init_fn(module: nn.Module) -> None:
            if not has_meta_tensors(module):
                return
            if self.init_method_using_config is not None:
                for m in module.modules():
                    if any(t.is_meta for t in _own_tensors(m)):
                        self.init_method_using_config(m)
                        self.count_num_params(m)
                return
            st = smp.state
            device = torch.device("cpu") if st.config.cpu_offload else st.device
            materialize_meta_model(module, device, st.config.random_seed)
            for m in module.modules():
                self.count_num_params(m)

        return param_init_fn

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """fn(module): re-tie tied weights (the model's `tie_weights()`), as SMP's does."""

        def post_param_init_fn(module: nn.Module) -> None:
            tie = getattr(module, "tie_weights", None)
            if callable(tie):
                tie()

        return post_param_init_fn

    def count_num_params(self, module: nn.Module, *args: nn.Parameter) -> None:
        """Count the parameters an init call filled (module's own, plus `args`)."""
        params = list(module.parameters(recurse=False)) + list(args)
        self.num_params_inited += sum(p.numel() for p in params)

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """On exit: every parameter and buffer of the model is materialised, on smp's device
        (or the host under cpu_offload); AssertionError names the first that is not."""
        yield
        if not enabled:
            return
        st = smp.state
        expected = "cpu" if st.config.cpu_offload else st.device.type
        for kind, named in (("parameter", self.model.named_parameters()), ("buffer", self.model.named_buffers())):
            for name, tensor in named:
                assert not tensor.is_meta, f"{kind} {name!r} is still on the meta device after initialisation"
                device = tensor.device.type
                assert device == expected, f"{kind} {name!r} is on {device}, expected {expected}"
        if self.verbose:
            total = sum(p.numel() for p in self.model.parameters())
            log.info("DelayedParamIniter: all %d parameter elements (this rank's shards) are initialised", total)
