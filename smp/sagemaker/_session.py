"""`smp.sagemaker.init`: SMP v2's `torch.sagemaker.init` on `smp.init`, plus the two things SMP's
init did to the process that a ported script still relies on: it told the user where its config
keys mean something else, and it stood between the script and FSDP1 (here: to stop the FSDP1
wrap that smp's transform makes redundant)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

import smp
from smp.config import ConfigSource, SMPConfig
from smp.errors import SMPWarning
from smp.mesh import ParallelDims
from smp.sagemaker._guide import MigrationError, section


class SMPv2DifferenceWarning(SMPWarning):
    """An SMP v2 config key whose value means something else in smp (filter it once read)."""


_warned: set[str] = set()  # each difference is reported once per process


def init(config: ConfigSource = None) -> None:
    """`torch.sagemaker.init(config)`: `smp.init(config)`. With no config it reads SageMaker's
    $SM_HP_MP_PARAMETERS (the estimator's mp_parameters), else the file in $SMP_CONFIG."""
    st = smp.init(config)
    for key, message in config_differences(st.config, st.dims):
        if key not in _warned:
            _warned.add(key)
            warnings.warn(message, SMPv2DifferenceWarning, stacklevel=2)
    install_fsdp1_guard()


def config_differences(cfg: SMPConfig, dims: ParallelDims) -> list[tuple[str, str]]:
    """(key, message) for each config value this run reads differently from SMP v2."""
    found = []
    anchor = section("config-keys-that-mean-something-else")
    if cfg.hybrid_shard_degree == 0 and dims.dp > 1:
        found.append(("hybrid_shard_degree", (
            f"hybrid_shard_degree: 0 shards every parameter over all {dims.dp} data-parallel ranks "
            f"in smp; SMP v2 deferred to the sharding_strategy the script passed to FSDP "
            f"(HYBRID_SHARD meant groups of 8). To shard inside groups of k, set "
            f"hybrid_shard_degree: k ({anchor})"
        )))
    if "sm_activation_offloading" not in cfg.model_fields_set:
        found.append(("sm_activation_offloading", (
            "sm_activation_offloading is not set: SMP v2 defaults it to true, smp to false, so "
            "`if tsm.state.sm_activation_offloading: offload_wrapper(...)` no longer runs. Set it "
            f"explicitly; when true smp.transform offloads every block itself ({anchor})"
        )))
    elif cfg.sm_activation_offloading:
        found.append(("sm_activation_offloading", (
            "sm_activation_offloading: true makes smp.transform offload every block's saved "
            "activations itself; remove the script's offload_wrapper(model), which would offload "
            f"a second time ({anchor})"
        )))
    if "allow_empty_shards" in cfg.model_fields_set and not cfg.allow_empty_shards:
        found.append(("allow_empty_shards", (
            "allow_empty_shards: false has no effect in smp: FSDP2 pads uneven shards and "
            f"allows empty ones on every run; remove the key ({anchor})"
        )))
    return found


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


def install_fsdp1_guard() -> None:
    """Make FSDP1's constructor refuse a module that smp already sharded, before FSDP1 fails on
    it deep inside (or, on GPUs, wraps it a second time). Other FSDP1 uses are untouched."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    original = FullyShardedDataParallel.__init__
    if getattr(original, "_smp_fsdp1_guard", False):
        return

    @functools.wraps(original)
    def guarded_init(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if isinstance(module, nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules()):
            raise MigrationError(_fsdp1_wrap_message(type(module).__name__))
        original(self, module, *args, **kwargs)

    guarded_init._smp_fsdp1_guard = True  # type: ignore[attr-defined]
    FullyShardedDataParallel.__init__ = guarded_init
