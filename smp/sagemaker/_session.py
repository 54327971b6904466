"""`smp.sagemaker.init`: SMP v2's `torch.sagemaker.init` on `smp.init`, plus the two things SMP's
init did to the process that a ported script still relies on: it told the user where its config
keys mean something else, and it stood between the script and FSDP1 (here: to stop the FSDP1
wrap that smp's transform makes redundant)."""

from __future__ import annotations

import warnings

import smp
from smp.config import ConfigSource, SMPConfig
from smp.errors import SMPWarning
from smp.mesh import ParallelDims
from smp.reliability.exit import end_run_at_exit
from smp.runtime import register_shutdown_hook
from smp.sagemaker._guide import section
from smp.sagemaker.dcp_coordinator import CoordinatorPatch
from smp.sagemaker.fsdp1 import Fsdp1Patch


class SMPv2DifferenceWarning(SMPWarning):
    """An SMP v2 config key whose value means something else in smp (filter it once read)."""


_warned: set[str] = set()  # each difference is reported once per process


def init(config: ConfigSource = None) -> None:
    """`torch.sagemaker.init(config)`: `smp.init(config)`. With no config it reads SageMaker's
    $SM_HP_MP_PARAMETERS (the estimator's mp_parameters), else the file in $SMP_CONFIG."""
    st = smp.init(config)
    # SMP v2 scripts end with dist.destroy_process_group(), never smp.shutdown(): at exit, shut
    # down and release the mesh groups before the interpreter finalizes (smp/reliability/exit.py)
    end_run_at_exit(st.mesh, st.dp_mesh)
    for key, message in config_differences(st.config, st.dims):
        if key not in _warned:
            _warned.add(key)
            warnings.warn(message, SMPv2DifferenceWarning, stacklevel=2)
    _open_session()


# What smp.sagemaker.init adds to the session, undone at its shutdown.
_PATCH: tuple[Fsdp1Patch, CoordinatorPatch] | None = None


def _open_session() -> None:
    global _PATCH
    if _PATCH is None:
        _PATCH = (Fsdp1Patch(), CoordinatorPatch())
    register_shutdown_hook(_close_session)


def _close_session() -> None:
    """Shutdown hook: FSDP1 and DCP's deprecated functions get torch's own back."""
    global _PATCH
    if _PATCH is not None:
        for patch in _PATCH:
            patch.remove()
        _PATCH = None


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
    if "activation_offloading" not in cfg.model_fields_set:
        found.append(("sm_activation_offloading", (
            "sm_activation_offloading is not set: SMP v2 defaults it to true, smp to false, so "
            "`if tsm.state.sm_activation_offloading: offload_wrapper(...)` no longer runs. Set it "
            f"explicitly; when true smp.transform offloads every block itself ({anchor})"
        )))
    elif cfg.activation_offloading and cfg.activation_offload_min_bytes > 0:
        found.append(("activation_offload_min_bytes", (
            f"activation_offload_min_bytes: {cfg.activation_offload_min_bytes} keeps saved "
            f"activations under that size on the device; SMP v2 offloaded every one. Leave the key "
            f"out (a config that says sm_activation_offloading then offloads all) or set 0 ({anchor})"
        )))
    if "allow_empty_shards" in cfg.model_fields_set and not cfg.allow_empty_shards:
        found.append(("allow_empty_shards", (
            "allow_empty_shards: false has no effect in smp: FSDP2 pads uneven shards and "
            f"allows empty ones on every run; remove the key ({anchor})"
        )))
    return found
