"""Pipeline parallelism x context parallelism: cases that run on every rank of a RankPool; each
returns plain data."""

from __future__ import annotations

import copy

import torch

import smp
import smp.pipeline
from smp.pipeline import schedule
from tests.pipeline.pipeline_cases import GLOBAL_BATCH, SEQ, VOCAB, tiny_model
from tests.pipeline.pipeline_compose_cases import IGNORE, _compare


def _local_positions(rows_for_cp_rank):
    """Negative control: the chunks' positions counted from 0 on each rank (what a stage computes
    from its inputs when it is not told where its chunk sits)."""

    def broken(input_ids, labels, mask, positions, setup):
        ids, targets, inputs = rows_for_cp_rank(input_ids, labels, mask, positions, setup)
        inputs["position_ids"] = torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()
        return ids, targets, inputs

    return broken


def _shift_inside_chunks(rows_for_cp_rank):
    """Negative control: labels shifted inside this rank's chunks, not over the whole row."""

    def broken(input_ids, labels, mask, positions, setup):
        ids, _, inputs = rows_for_cp_rank(input_ids, labels, mask, positions, setup)
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
            # pp x cp runs no dp > 1 beside it: every rank passes the whole batch, which
            # step cuts for its cp rank.
            return _compare(model, reference, steps, padded, broken=None)
    finally:
        schedule._rows_for_cp_rank = saved


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


