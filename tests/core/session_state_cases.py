"""Multi-rank cases for tests/core/test_session_state.py: what one smp session sets up (a patch of
transformers' MoE loss, async saves, the context-parallel setup) is not seen by another."""

from __future__ import annotations

import copy

import torch

import smp
from smp.checkpointing.commit import async_save
from smp.context_parallel.attention import activate as activate_cp, active as active_cp, deactivate as deactivate_cp
from smp.expert_parallel import load_balancing
from smp.testing.distributed import local_rows
from smp.testing.models import random_batch, tiny_llama
from tests.expert_parallel.expert_parallel_cases import GLOBAL_BATCH, SEQ, VOCAB, build


def _probe(model, seen: dict, key: str, modeling) -> None:
    """Record which load-balancing function the model's forward would call (its first decoder
    layer runs inside the forward, before the loss)."""
    def hook(module, args, output):
        seen.setdefault(key, modeling.load_balancing_loss_func)

    model.model.layers[0].register_forward_hook(hook)


def moe_patch_isolation(leak: bool = False) -> dict:
    """Session 1 (dp 2): a tiny Mixtral, transformed (its load-balancing loss summed over the
    ranks) beside an untransformed copy. Session 2 (dp 2): a dense Llama, transformed, and an
    untransformed Mixtral. Reports which function each forward saw, and the aux losses.
    `leak` (negative control): smp's function left in transformers' module when session 1 ends,
    as a process-wide patch would be."""
    import transformers.models.mixtral.modeling_mixtral as mixtral

    original = mixtral.load_balancing_loss_func
    seen: dict = {}
    report: dict = {}
    with smp.session({}):
        batch = local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=7))
        torch.manual_seed(0)
        reference = build("mixtral")
        weights = copy.deepcopy(reference.state_dict())
        model = smp.transform(copy.deepcopy(reference))
        _probe(model, seen, "s1_transformed", mixtral)
        _probe(reference, seen, "s1_reference", mixtral)
        report["s1_patched_after_transform"] = mixtral.load_balancing_loss_func is not original
        model(input_ids=batch, labels=batch)
        report["s1_patched_between_forwards"] = mixtral.load_balancing_loss_func is not original
        report["s1_reference_aux"] = float(reference(input_ids=batch, labels=batch).aux_loss)
        if leak:
            leaked = seen["s1_transformed"]
    if leak:
        mixtral.load_balancing_loss_func = leaked
    try:
        with smp.session({}):
            dense = smp.transform(tiny_llama(vocab_size=VOCAB))
            dense(input_ids=batch, labels=batch)
            other = build("mixtral")
            other.load_state_dict(weights)
            _probe(other, seen, "s2_mixtral", mixtral)
            try:
                report["s2_aux"] = float(other(input_ids=batch, labels=batch).aux_loss)
            except Exception:  # the leaked function sums over session 1's group, which is gone
                if not leak:
                    raise
                report["s2_aux"] = None
        report["patched_after_sessions"] = mixtral.load_balancing_loss_func is not original
    finally:
        mixtral.load_balancing_loss_func = original
    report.update({
        "s1_transformed_saw_smp": seen["s1_transformed"] is not original,
        "s1_reference_saw_transformers": seen["s1_reference"] is original,
        "s2_mixtral_saw_transformers": seen["s2_mixtral"] is original,
        "s1_transformed_is_smp": getattr(seen["s1_transformed"], "__self__", None).__class__.__module__
        == load_balancing.__name__,
    })
    return report


def scoped_objects() -> dict:
    """Session 1 makes an async-save group and a context-parallel setup; session 2 sees neither,
    and session 1's are closed (its async-save group destroyed) by its shutdown."""
    import torch.distributed as dist

    report: dict = {}
    with smp.session({"context_parallel_degree": 2}):
        saves = async_save.saves()
        group = saves.group(None)
        smp.transform(tiny_llama(vocab_size=VOCAB))
        report["s1_cp_active"] = active_cp() is not None
    report["s1_group_destroyed"] = group not in dist.distributed_c10d._world.pg_map
    with smp.session({}):
        report["s2_cp_active"] = active_cp() is not None
        report["s2_same_saves"] = async_save.saves() is saves
    report["outside_cp_active"] = active_cp() is not None
    return report
