"""Cases for transformers' `local_params` style (run on every rank of a RankPool; each returns
plain data): attention modules whose own bare per-head parameters (attention sinks; Beam's
attention-gate bias) are split by their own plan entries. Families built at the model-coverage
tiny shape (hidden 64, 2 layers, 4 heads / 2 key-value heads, vocab 256)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import smp
from smp.testing.models import random_batch
from tests.models.model_coverage_cases import tiny_config
from tests.tensor_parallel.tp_vocabulary_cases import error_of_transform, sgd_comparison

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 256
PER_HEAD = ("sinks", "gate_bias")  # the bare per-head parameters these families split


def build(kind: str) -> nn.Module:
    """`kind`'s tiny model, its per-head parameters drawn at random: transformers initialises
    sinks and gate biases to zero (all heads alike), where a misaligned split would not show."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rpartition(".")[2] in PER_HEAD:
                p.normal_(std=1.0)
    return model


def own_plan(kind: str, drop: tuple[str, ...] = (), **changes: str) -> dict[str, str]:
    """The model's shipped plan, as a user plan: entries ending with one of `drop` removed,
    `changes` (suffix -> style) applied to the entries ending with that suffix."""
    plan = dict(build(kind)._tp_plan)
    plan = {k: v for k, v in plan.items() if not k.endswith(drop)} if drop else plan
    return {k: next((s for suffix, s in changes.items() if k.endswith(suffix)), v) for k, v in plan.items()}


def equivalence(config: dict, kind: str, steps: int = 3, misalign: bool = False) -> dict:
    """TP run vs the single-process run on the same init and global batch over `steps` SGD steps:
    the largest loss and gradient gaps, per parameter too, and what smp applied. `misalign`: the
    negative control, the per-head parameters split round-robin (rank r: heads r, r+tp, ...)
    while the projections hold contiguous heads."""
    from smp.tensor_parallel.styles import LocalParams

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = copy.deepcopy(reference)
        if misalign:
            LocalParams.placement = _StridedShard(0, split_factor=smp.state.tp_size)
        try:
            model = smp.transform(model)
        finally:
            LocalParams.placement = Shard(0)
        split = [n for n, p in model.named_parameters()
                 if n.rpartition(".")[2] in PER_HEAD and isinstance(p, DTensor)
                 and "tp" in (p.device_mesh.mesh_dim_names or ())]
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
        return {**sgd_comparison(model, reference, batch, steps), "split_per_head": split,
                "tp_plan": dict(getattr(model, "_smp_tp_plan", {}))}


def transform_error(config: dict, kind: str, plan: dict) -> str:
    """The smp.Error smp.transform raises for `kind` under the user plan `plan` ('' if none)."""
    return error_of_transform(config, lambda: build(kind), plan)
