"""Pipeline parallelism x context parallelism: cases that run on every rank of a RankPool; each
returns plain data."""

from __future__ import annotations

import copy

import torch

import smp
import smp.pipeline
from smp.pipeline import schedule
from smp.testing.distributed import full_tensor, world_mean
from smp.testing.models import random_batch
from tests.pipeline_cases import GLOBAL_BATCH, SEQ, VOCAB, tiny_model
from tests.pipeline_compose_cases import IGNORE, padded_batch


def _local_positions(rows_for_cp_rank):
    """Negative control: the chunks' positions counted from 0 on each rank (what a stage computes
    from its inputs when it is not told where its chunk sits)."""

    def broken(input_ids, labels, mask, setup):
        ids, targets, inputs = rows_for_cp_rank(input_ids, labels, mask, setup)
        inputs["position_ids"] = torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()
        return ids, targets, inputs

    return broken


def _shift_inside_chunks(rows_for_cp_rank):
    """Negative control: labels shifted inside this rank's chunks, not over the whole row."""

    def broken(input_ids, labels, mask, setup):
        ids, _, inputs = rows_for_cp_rank(input_ids, labels, mask, setup)
        chunk = labels.index_select(1, inputs["position_ids"][0])
        return ids, torch.cat([chunk[:, 1:], torch.full_like(chunk[:, :1], IGNORE)], dim=1), inputs

    return broken


BROKEN = {"local_positions": _local_positions, "shift_inside_chunks": _shift_inside_chunks}


def pp_x_cp(config: dict, steps: int = 2, padded: bool = False, broken: str | None = None, layers: int = 2) -> dict:
    """smp.pipeline.step under `config` (context_parallel_degree > 1) vs one process on the same
    init and global batch, over `steps` SGD steps: the largest loss and gradient differences.
    Every rank gets the whole rows (dp is 1); `broken` names a negative control (BROKEN)."""
    saved = schedule._rows_for_cp_rank
    if broken is not None:
        schedule._rows_for_cp_rank = BROKEN[broken](saved)
    try:
        with smp.session(config):
            torch.manual_seed(smp.state.config.random_seed)
            reference = tiny_model("llama", layers=layers)
            model = smp.transform(copy.deepcopy(reference))
            return _compare(model, reference, steps, padded)
    finally:
        schedule._rows_for_cp_rank = saved


def _compare(model, reference, steps: int, padded: bool) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": []}
    for _ in range(steps):
        if padded:
            ids, mask = padded_batch()
            labels = ids.masked_fill(mask == 0, IGNORE)
            ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        else:
            ids, mask = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100), None
            ref_loss = reference(input_ids=ids, labels=ids).loss
        loss = smp.pipeline.step(model, ids, attention_mask=mask)
        ref_loss.backward()
        report["losses"].append(float(ref_loss.detach()))
        report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss.detach())))
        for name, p in model.named_parameters():
            diff = float("inf") if p.grad is None else float((full_tensor(p.grad) - ref_params[name].grad).abs().max())
            report["grad_diff"] = max(report["grad_diff"], diff)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return report


def step_error(config: dict, seq: int = SEQ, loss_fn: bool = False, evaluate: bool = False) -> str:
    """The smp.Error smp.pipeline.step (or evaluate) raises on this rank ('' if none)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_model("llama", layers=2))
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq))
        try:
            if evaluate:
                smp.pipeline.evaluate(model, ids)
            else:
                smp.pipeline.step(model, ids, loss_fn=(lambda logits, labels: logits.sum()) if loss_fn else None)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
    return ""


