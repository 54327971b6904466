"""Packed-sequence cases (several documents back to back in one row, position ids restarting at
each, no padding: TRL's packing, `DataCollatorWithFlattening`) that run on every rank of a
RankPool (FSDP, TP + SP, context parallel, pipeline parallel and its compositions, expert
parallel); each returns plain data.

The reference is one process running the whole packed batch through transformers' own model with
no attention mask and `use_cache=False` (transformers then reads the documents from
`position_ids`); `reference_vs_documents` checks that reference against the documents run one
by one. Labels follow DataCollatorWithFlattening: -100 at each document's first token, so no
document predicts the next one's first token.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from typing import Iterator

import torch
from torch import nn

import smp
import smp.context_parallel as cp
from smp.context_parallel import sharding, ulysses
from smp.expert_parallel import is_expert_parallel
from smp.pipeline import schedule
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import tiny_llama
from tests.context_parallel.context_parallel_cases import VOCAB, UserBlock, UserModel, build

cp_attention = importlib.import_module("smp.context_parallel.attention")  # the module, not the function

SEQ = 16
# Document lengths of each row: three documents per row (13 targets each, so every data-parallel
# rank's rows hold the same number of targets); several cross the 4-token chunk boundaries of
# cp 2 with load balancing.
DOCUMENTS = [[5, 7, 4], [3, 9, 4], [8, 4, 4], [6, 6, 4]]


def packed_batch(documents: list[list[int]] = DOCUMENTS, seed: int = 7) -> dict[str, torch.Tensor]:
    """input_ids, position_ids (restarting at 0 at each document) and labels (-100 at each
    document's first token), as DataCollatorWithFlattening builds them, minus the flattening."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(documents), SEQ), generator=g)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in documents])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def documents_of(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each document's token ids, row by row."""
    out = []
    for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        out += [ids[a:b] for a, b in zip(starts, starts[1:])]
    return out


class PackedUserBlock(UserBlock):
    def forward(self, x, padding, position_ids=None):  # type: ignore[override]
        self._positions = position_ids
        return super().forward(x, padding)

    def attend(self, q, k, v, padding):
        return cp.attention(q, k, v, causal=True, key_padding_mask=padding, position_ids=self._positions)


class PackedUserModel(UserModel):
    """The user model of tests/context_parallel/context_parallel_cases.py, its attention told the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PackedUserBlock(32, 64) for _ in self.layers)

    def forward(self, input_ids, position_ids, attention_mask=None):
        x = self.embed(input_ids) + self.positions(position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask, position_ids)
        return self.head(self.norm(x))


def _build(kind: str) -> nn.Module:
    return PackedUserModel() if kind == "user" else build(kind)


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor], **extra) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                 use_cache=False, **extra).loss


def _reference_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if isinstance(model, PackedUserModel):
        one = sharding.shard_batch(batch, cp_size=1, cp_rank=0, load_balance=False)
        return cp.token_loss(model(one["input_ids"], one["position_ids"]), one)
    return hf_loss(model, batch)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_vs_documents(kind: str = "llama", variant: str = "packed") -> dict:
    """One process: the packed batch's loss and gradients vs the documents run one by one (each
    document's summed token losses over the batch's target count). `variant` (negative
    controls): "global_positions" (positions not restarting), "cache" (use_cache=True: in
    train mode transformers builds a cache and attends across documents), "no_boundary_labels"
    (each document's first token left as a target of the previous one)."""
    torch.manual_seed(0)
    model = _build(kind)
    batch = packed_batch()
    targets = int((sharding.shift_labels(batch["labels"]) != -100).sum())
    total = 0.0
    for doc in documents_of(batch):
        loss = model(input_ids=doc[None], labels=doc[None], use_cache=False).loss * (len(doc) - 1) / targets
        loss.backward()
        total += float(loss.detach())
    one_by_one = _grads(model)
    model.zero_grad()
    packed = dict(batch)
    extra = {}
    if variant == "global_positions":
        packed["position_ids"] = torch.arange(SEQ).expand_as(batch["input_ids"])
    elif variant == "cache":
        extra = {"use_cache": True}
    elif variant == "no_boundary_labels":
        packed["labels"] = batch["input_ids"]
    elif variant != "packed":
        raise ValueError(variant)
    model.train()
    if extra:
        loss = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"],
                     **extra).loss
    else:
        loss = hf_loss(model, packed)
    loss.backward()
    gap = max(float((p.grad - one_by_one[n]).abs().max()) for n, p in model.named_parameters())
    return {"loss_diff": abs(float(loss.detach()) - total), "grad_diff": gap, "targets": targets}


@contextlib.contextmanager
def _corrupted(kind: str | None) -> Iterator[None]:
    """`ignore_boundaries`: smp's context parallel attention sees one document per row (every
    document key 0); `wrong_head_order`: Ulysses puts the head groups back in reverse rank order."""
    if kind is None:
        yield
        return
    saved = cp_attention.document_keys, ulysses.heads_home
    if kind == "ignore_boundaries":
        def no_documents(position_ids, index, batch):
            return torch.zeros(batch, index.numel(), device=index.device)
        cp_attention.document_keys = no_documents
    elif kind == "wrong_head_order":
        real = ulysses.heads_home

        def reversed_home(parts, group, size):
            out = real(parts, group, size)
            return torch.cat(out.chunk(size, dim=1)[::-1], dim=1)
        ulysses.heads_home = reversed_home
    else:
        raise ValueError(kind)
    try:
        yield
    finally:
        cp_attention.document_keys, ulysses.heads_home = saved


def _run_loss(model: nn.Module, rows: dict[str, torch.Tensor], global_targets: int) -> torch.Tensor:
    """This rank's loss on its rows: through shard_batch under context parallel (and for the
    user model), else the HF model's own loss over the global target count / dp."""
    if smp.state.cp_size > 1 or isinstance(model, PackedUserModel):
        batch = cp.shard_batch(rows)
        if isinstance(model, PackedUserModel):
            return cp.token_loss(model(batch["input_ids"], batch["position_ids"]), batch)
        return model(**batch, use_cache=False).loss
    return hf_loss(model, rows, num_items_in_batch=torch.tensor(global_targets / smp.state.dp_size))


def equivalence(config: dict, kind: str = "llama", steps: int = 2, variant: str | None = None,
                corrupt: str | None = None) -> dict:
    """smp run on the packed batch vs one process (transformers' own packed attention): same
    init, SGD steps; max |loss gap| and |gradient gap|. `variant` "global_positions": the smp run
    gets positions that do not restart (negative control)."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = _build(kind)
        model = copy.deepcopy(reference)
        batch = packed_batch()
        targets = int((sharding.shift_labels(batch["labels"]) != -100).sum())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_losses, ref_grads = [], []
        for _ in range(steps):
            loss = _reference_loss(reference, batch)
            loss.backward()
            ref_losses.append(float(loss.detach()))
            ref_grads.append(_grads(reference))
            ref_opt.step()
            ref_opt.zero_grad()

        model = smp.transform(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = {name: local_rows(t) for name, t in batch.items()}
        if variant == "global_positions":
            rows["position_ids"] = torch.arange(SEQ).expand_as(rows["input_ids"])
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": ref_losses, "cp_size": smp.state.cp_size}
        with _corrupted(corrupt):
            for step in range(steps):
                loss = _run_loss(model, rows, targets)
                loss.backward()
                report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - ref_losses[step]))
                gap = max(float((full_tensor(p.grad) - ref_grads[step][n]).abs().max())
                          for n, p in model.named_parameters())
                report["grad_diff"] = max(report["grad_diff"], gap)
                opt.step()
                opt.zero_grad()
        return report


def shard_error(config: dict, padded: bool = True, jump: bool = False) -> str:
    """The error shard_batch raises for packed rows with an attention mask, or positions that
    jump up inside a row ('' if none)."""
    with smp.session(config):
        smp.transform(build("llama"))
        batch = packed_batch()
        if padded:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            batch["attention_mask"][:, -2:] = 0
        if jump:
            batch["position_ids"] = batch["position_ids"].clone()
            batch["position_ids"][:, 3] += 5
        try:
            cp.shard_batch({name: local_rows(t) for name, t in batch.items()})
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""


@contextlib.contextmanager
def _positions_not_sent(broken: bool) -> Iterator[None]:
    """Negative control for pipeline parallelism: the stages are not handed the batch's
    position_ids (each numbers its tokens 0, 1, 2, ... over the whole row)."""
    if not broken:
        yield
        return
    saved = schedule.pipeline_batch

    def without_positions(batch, caller):
        return saved({k: v for k, v in batch.items() if k != "position_ids"}, caller)
    schedule.pipeline_batch = without_positions
    try:
        yield
    finally:
        schedule.pipeline_batch = saved


def _step_model(kind: str, layers: int = 2) -> nn.Module:
    """"llama" (tests/context_parallel/context_parallel_cases.py, with `layers` decoder layers), or
    "mixtral" as tests/expert_parallel/expert_parallel_cases.py builds it, without the
    load-balancing loss (smp.step refuses it on several data ranks)."""
    if kind == "mixtral":
        from tests.expert_parallel.expert_parallel_cases import build as build_moe

        model = build_moe("mixtral")
        model.config.output_router_logits = False
        return model
    if kind == "llama" and layers != 2:
        return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers)
    return _build(kind)


def step_equivalence(config: dict, steps: int = 2, use_cache: bool | None = False, labels: bool = True,
                     broken: str | None = None, kind: str = "llama") -> dict:
    """smp.step (the one training step for every layout, pipeline included) on the packed batch
    vs one process: loss and every gradient over `steps` SGD steps, and smp.evaluate's loss
    after each. `use_cache` None: the batch does not say (the model's config then builds a cache
    in train mode). `labels` False: the batch carries none (both sides then train on input_ids, a
    document's last token predicting the next one's first). `broken` (negative controls): "positions_not_sent", a pipeline's
    stages never see the positions; "global_positions", the smp run's positions do not restart.
    `kind`: "llama" or "mixtral" (_step_model); a pipeline whose ranks hold several stages
    (interleaved, looped and V schedules) gets a llama of one layer per stage."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        stages = smp.state.pp_size * smp.state.config.pipeline.local_stages()
        reference = _step_model(kind, layers=max(2, stages))
        model = copy.deepcopy(reference)
        batch = packed_batch()
        if not labels:
            batch["labels"] = batch["input_ids"]
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_losses, ref_grads, ref_evals = [], [], []
        for _ in range(steps):
            loss = hf_loss(reference, batch)
            loss.backward()
            ref_losses.append(float(loss.detach()))
            ref_grads.append(_grads(reference))
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.no_grad():
                ref_evals.append(float(hf_loss(reference, batch)))
        model = smp.transform(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = {name: local_rows(t) for name, t in batch.items() if labels or name != "labels"}
        if use_cache is not None:
            rows["use_cache"] = use_cache
        if broken == "global_positions":
            rows["position_ids"] = torch.arange(SEQ).expand_as(rows["input_ids"])
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "eval_diff": 0.0, "losses": ref_losses,
                  "all_grads": sorted(ref_grads[0]),
                  "expert_parallel_modules": sum(is_expert_parallel(m) for m in model.modules())}
        with _positions_not_sent(broken == "positions_not_sent"):
            for step in range(steps):
                loss = smp.step(model, rows)
                report["loss_diff"] = max(report["loss_diff"], abs(float(loss) - ref_losses[step]))
                grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
                report["grad_diff"] = max(report["grad_diff"], max(
                    float((g - ref_grads[step][n]).abs().max()) for n, g in grads.items()))
                report["grads"] = sorted(grads)
                opt.step()
                opt.zero_grad()
                evaluated = smp.evaluate(model, rows)  # the forward alone, after the update
                report["eval_diff"] = max(report["eval_diff"], abs(float(evaluated) - ref_evals[step]))
        # the torch schedule the pipeline ran (none without a pipeline)
        report["schedules"] = sorted({type(s).__name__ for s in getattr(model, "_schedules", {}).values()})
        return report


def step_error(config: dict, padded: bool = False, jump: bool = False) -> str:
    """The error smp.step raises for the packed batch ('' if none); `padded`: with an attention
    mask, `jump`: a position jumping up inside a row."""
    with smp.session(config):
        model = smp.transform(_build("llama"))
        batch = packed_batch()
        if padded:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            batch["attention_mask"][:, -2:] = 0
            batch["labels"] = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
        if jump:
            batch["position_ids"] = batch["position_ids"].clone()
            batch["position_ids"][:, 3] += 5
        try:
            smp.step(model, {name: local_rows(t) for name, t in batch.items()})
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""
