"""Pipeline parallelism composed with tensor and expert parallelism, FSDP, the zero-bubble
schedules and padded batches: cases that run on every rank of a RankPool; each returns plain data."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import smp
import smp.composition
import smp.pipeline
from smp.testing.distributed import full_tensor, world_mean
from smp.testing.models import random_batch
from tests.pipeline.pipeline_cases import GLOBAL_BATCH, SEQ, VOCAB, tiny_model

IGNORE = -100


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch right-padded to different lengths (so micro-batches and data-parallel
    ranks hold different target counts), and its attention mask."""
    ids = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
    lengths = torch.tensor([16, 3, 9, 16, 5, 12, 2, 7])[:GLOBAL_BATCH]
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _rows(t: torch.Tensor, shift: bool = False) -> torch.Tensor:
    """This rank's data-parallel rows; `shift` hands the second TP rank other rows (the negative
    control: a TP group must share its rows)."""
    per = t.shape[0] // smp.state.dp_size
    if shift and smp.state.tp_rank == 1:
        t = t.roll(1, 0)
    return t[smp.state.dp_rank * per:(smp.state.dp_rank + 1) * per]


def _mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)


def _sharded_axes(model: torch.nn.Module) -> list[str]:
    """The mesh axes some parameter of this rank is split over (Shard placements)."""
    axes = set()
    for p in model.parameters():
        if isinstance(p, DTensor):
            for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
                if isinstance(placement, Shard):
                    axes.add(name)
    return sorted(axes)


def compose(config: dict, kind: str = "llama", steps: int = 2, padded: bool = False,
            broken: str | None = None, layers: int = 4) -> dict:
    """smp.pipeline.step under `config` vs one process on the same init and global batch, over
    `steps` SGD steps: the largest loss and gradient differences, and the mesh axes this rank's
    parameters are split over.

    padded: a right-padded batch with its attention mask (the reference: the model's own loss
    with the mask and labels of -100 on padding). broken (negative controls): "tp_rows" hands a
    TP group's ranks different rows; "microbatch_mean" averages per-micro-batch means (wrong when
    micro-batches hold different target counts); "resharded" runs a split-backward schedule with
    FSDP resharding after forward, past the config check that refuses it."""
    saved_table = smp.composition.REFUSED
    if broken == "resharded":  # the table's row that refuses it, left out
        smp.composition.REFUSED = tuple(r for r in saved_table if "reshard" not in r.features)
    try:
        with smp.session(config):
            torch.manual_seed(smp.state.config.random_seed)
            reference = tiny_model(kind, layers=layers)
            model = smp.transform(copy.deepcopy(reference))
            report = _compare(model, reference, steps, padded, broken)
            report["sharded_over"] = _sharded_axes(model)
            return report
    finally:
        smp.composition.REFUSED = saved_table


def _compare(model, reference, steps: int, padded: bool, broken: str | None) -> dict:
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
        loss_fn = _mean_ce if broken == "microbatch_mean" else None
        local_mask = None if mask is None else _rows(mask)
        rows = _rows(ids, shift=broken == "tp_rows")
        loss = smp.pipeline.step(model, rows, attention_mask=local_mask, loss_fn=loss_fn)
        ref_loss.backward()
        report["losses"].append(float(ref_loss.detach()))
        report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss.detach())))
        for name, p in model.named_parameters():
            # A gradient that never arrived counts as an infinite difference.
            diff = float("inf") if p.grad is None else float((full_tensor(p.grad) - ref_params[name].grad).abs().max())
            report["grad_diff"] = max(report["grad_diff"], diff)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return report


def transform_error(config: dict, kind: str = "llama", model_config: dict | None = None) -> str:
    """The smp.Error smp.transform raises on this rank ('' if none); `model_config` is set on the
    model's config first (e.g. output_router_logits)."""
    with smp.session(config):
        model = tiny_model(kind)
        for key, value in (model_config or {}).items():
            setattr(model.config, key, value)
        try:
            smp.transform(model)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
    return ""


def step_errors(config: dict) -> list[str]:
    """What smp.pipeline.step says to a left-padded mask and to labels on padding."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_model("llama"))
        ids = torch.randint(0, VOCAB, (2, 8))
        left = torch.ones(2, 8, dtype=torch.long)
        left[0, :3] = 0
        right = torch.ones(2, 8, dtype=torch.long)
        right[0, 5:] = 0
        errors = []
        for attempt in (lambda: smp.pipeline.step(model, ids, attention_mask=left),
                        lambda: smp.pipeline.step(model, ids, ids, attention_mask=right)):
            try:
                attempt()
                errors.append("")
            except smp.Error as e:
                errors.append(f"{type(e).__name__}: {e}")
        return errors
