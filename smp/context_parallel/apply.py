"""`apply_context_parallel(model, cp_mesh, algorithm, load_balance)`: make the model's attention
see whole sequences while each rank of `cp_mesh` holds only its chunks of them.

Nothing is wrapped or resharded: a Hugging Face model's attention is switched to smp's
("smp_cp", smp/context_parallel/hf.py); a user model calls `smp.context_parallel.attention`
itself. Attention that bypasses it is refused by the attention probe (probe.py) before the
first forward communicates. The batch is cut by `smp.context_parallel.shard_batch`. FSDP
(applied after, over dp_shard x cp) reduces the gradients over every rank that saw part of
the batch.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smp.context_parallel import hf
from smp.context_parallel.attention import ALGORITHMS, ContextParallelSetup, activate
from smp.context_parallel.probe import AttentionProbe, meta_stand_ins
from smp.context_parallel.ulysses import check_heads
from smp.errors import ConfigError, UsageError


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, algorithm: str, load_balance: bool,
                           tp: int = 1) -> AttentionProbe:
    """Switch the model's attention to context parallel; returns the attention probe, which the
    caller installs with `install_attention_probe` once FSDP has wrapped the model. `tp`: the
    tensor parallel degree (Ulysses splits the heads tensor parallel left on each rank)."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"context_parallel.algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if hf.is_hf_model(model):
        hf.check_hf_model(model)
        if algorithm == "ulysses":
            _check_ulysses_heads(model.config, cp_mesh.size(), tp)
        hf.use_context_parallel_attention(model)
    else:
        _check_user_model(model)
    setup = ContextParallelSetup(
        group=cp_mesh.get_group(), rank=cp_mesh.get_local_rank(), size=cp_mesh.size(),
        algorithm=algorithm, load_balance=load_balance,
    )
    activate(setup)
    if hf.is_hf_model(model):
        hf.guard_inputs(model, setup)  # every forward says where its tokens sit (hf.py)
    _require_attention_calls(model, setup)
    if hf.is_hf_model(model):
        return AttentionProbe(setup=setup, stand_ins=meta_stand_ins(model), skipped_inputs=hf.LOSS_INPUTS,
                              prepare=hf.with_padding_mask)
    return AttentionProbe(setup=setup, stand_ins=meta_stand_ins(model))


def _check_ulysses_heads(config: Any, cp: int, tp: int) -> None:
    """ConfigError when a Hugging Face model's heads do not split over cp x tp (Ulysses)."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return  # the attention checks the heads it is given (ulysses.check_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    try:
        check_heads(heads, kv_heads, cp, tp)
    except UsageError as e:
        raise ConfigError(str(e)) from None


def _check_user_model(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            raise ConfigError(
                f"context_parallel_degree > 1: {name or type(model).__name__} is an "
                f"nn.MultiheadAttention, which attends only to this rank's chunk of the sequence; "
                f"compute attention with smp.context_parallel.attention(q, k, v, causal=True)"
            )


def _require_attention_calls(model: nn.Module, setup: ContextParallelSetup) -> None:
    """A forward that never called the context parallel attention attended to 1/cp of each
    sequence: wrong silently, so fail loudly after the first such forward. The probe
    (smp/context_parallel/probe.py) catches this before the first forward communicates; this
    check stays for the forwards after it, and for models the probe cannot run."""

    def reset(*_: Any) -> None:
        setup.calls = 0

    def check(*_: Any) -> None:
        if setup.calls == 0:
            raise UsageError(
                f"context_parallel_degree={setup.size}: {type(model).__name__}'s forward never called "
                f"smp.context_parallel.attention, so its attention saw only this rank's chunk of each "
                f"sequence; compute attention with smp.context_parallel.attention(q, k, v, causal=True)"
            )

    model.register_forward_pre_hook(reset)
    model.register_forward_hook(check)
