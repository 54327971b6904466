"""`smp.sagemaker.transform`: SMP v2's `torch.sagemaker.transform` signature on `smp.transform`.

SMP's transform rewrote a model for tensor parallelism and left sharding to the script's FSDP1
wrap; smp's transform does both (FSDP2), so the model it returns is ready to train.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

import smp
from smp.config import ConfigError
from smp.context_parallel.hf import accept_precut_inputs
from smp.sagemaker._guide import MigrationError, not_supported, section
from smp.sagemaker.fsdp1 import adopt, shard_mesh
from smp.sharding import has_meta_tensors
from smp.transform import transform as smp_transform

# SMP's cp_comm_type -> smp's context_parallel.algorithm (both: how K/V reach every cp rank).
CP_COMM_TYPES = {"p2p": "ring", "all_gather": "allgather"}


def transform(
    model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: str | None = None,
) -> nn.Module:
    """Shard `model` as the smp config says (tensor parallel, FSDP2, ...) and return it.

    device: must be the kind smp.init chose (smp places parameters on smp.state.device).
    dtype: the model is cast to it first (SMP: created in it).
    config: SMP's MoEConfig, checked against the init config's `moe:` section (smp reads it
      there); any other config is refused: parallelism comes from smp.init's config.
    load_state_dict_from_rank0: rank 0 holds the real weights (other ranks may hold a meta
      model); after sharding every rank's shards are loaded from rank 0's full state dict.
    cp_comm_type: "p2p" (smp: context_parallel.algorithm ring) or "all_gather" (allgather).
    """
    st = smp.state  # raises before smp.init
    if config is not None:
        _check_transform_config(config, st.config)
    _check_cp_comm_type(cp_comm_type, st)
    if device is not None and torch.device(device).type != st.device.type:
        raise MigrationError(
            f"transform(device={device!r}): smp places parameters on {st.device} (the backend "
            f"smp.init chose); drop the device argument (see {section('transform')})"
        )
    if dtype is not None:
        model.to(dtype)
    if not load_state_dict_from_rank0:
        model = smp_transform(model)
    else:
        full_state = _take_rank0_weights(model)
        smp_transform(model)  # every rank materialises alike (meta everywhere), then rank 0's weights win
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_state, options=options)
    # SMP v2 scripts cut each sequence for their cp rank themselves (2 x cp chunks, rank i keeps
    # chunks i and 2cp-1-i): smp completes positions and label shift from that layout.
    accept_precut_inputs(model)
    # What FSDP1 kept on the wrapped model (state_dict_type, optim_state_dict, process_group).
    mesh = shard_mesh(st)
    adopt(model, mesh.get_group(), mesh)
    return model


def _check_transform_config(config: Any, smp_config: Any) -> None:
    from smp.sagemaker.moe.moe_config import MoEConfig

    if isinstance(config, MoEConfig):
        config.check_matches(smp_config)
        return
    not_supported(
        "transform(model, config=...)", "transform",
        "smp takes every parallelism setting from the config given to smp.init / "
        "smp.sagemaker.init (e.g. tensor_parallel.plan); drop the config argument",
    )


def _check_cp_comm_type(cp_comm_type: str | None, st: Any) -> None:
    if cp_comm_type is None:
        return
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {sorted(CP_COMM_TYPES)}, got {cp_comm_type!r}")
    if st.cp_size == 1:
        return  # SMP too ignores it without context parallelism
    wanted, configured = CP_COMM_TYPES[cp_comm_type], st.config.context_parallel.algorithm
    if wanted != configured:
        raise ConfigError(
            f"transform(cp_comm_type={cp_comm_type!r}) asks for context_parallel.algorithm "
            f"{wanted!r}, but the config says {configured!r}; set context_parallel: "
            f"{{algorithm: {wanted}}} in the config and drop cp_comm_type (see {section('transform')})"
        )


def _take_rank0_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's full state dict (other ranks: {}); every model then moves to meta so that all
    ranks materialise the same way in transform (a per-rank difference would desynchronise its
    collectives). Rank 0's tensors stay alive in the returned dict until they are broadcast."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and has_meta_tensors(model):
        raise MigrationError(
            "transform(load_state_dict_from_rank0=True): rank 0 must hold the real weights, but "
            f"its model has parameters on the meta device (see {section('transform')})"
        )
    full_state = dict(model.state_dict()) if rank == 0 else {}
    model.to("meta")
    return full_state
