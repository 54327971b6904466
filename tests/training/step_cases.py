"""smp.step / smp.evaluate in every layout: cases that run on every rank of a RankPool; each
returns plain data. One loop (smp.step + optimizer.step) serves every layout."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import smp
from smp.context_parallel import sharding
from smp.expert_parallel import load_balancing
from smp.pipeline import schedule
from smp.testing.distributed import full_tensor
from smp.testing.models import TinyTransformer, random_batch
from tests.pipeline.pipeline_cases import VOCAB, tiny_model

ROWS, SEQ, IGNORE = 4, 16, -100
# Mixtral's own coefficient is 0.001; 0.1 makes its load-balancing term move the loss and the
# router gradients far beyond the tolerance when it is wrong (the negative control).
AUX_COEF = 0.1
LENGTHS = (16, 3, 9, 12)  # right padding: the data-parallel ranks and micro-batches hold different target counts


def padded_batch(seed: int, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """A global batch of right-padded rows with its mask and labels (-100 on padding)."""
    ids = random_batch(rows, SEQ, VOCAB, seed=seed)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS[:rows])[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def data_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's data-parallel rows of a global batch (tp, cp and pipeline ranks share them)."""
    per = batch["input_ids"].shape[0] // smp.state.dp_size
    return {k: v[smp.state.dp_rank * per:(smp.state.dp_rank + 1) * per] for k, v in batch.items()}


def _per_rank_count(labels, dp_group, device):
    """Negative control: each rank's loss normalised by its own rows' target count (times its
    share of the ranks), not the global batch's."""
    local = (labels[:, 1:] != IGNORE).sum().to(device, torch.float64)
    return local * (1 if dp_group is None else torch.distributed.get_world_size(dp_group))


def _cut_without_load_balance(shard_batch):
    """Negative control: rows cut into cp contiguous chunks while the attention expects the
    load-balanced layout (chunks i and 2cp-1-i)."""

    def broken(batch, *, cp_size, cp_rank, load_balance, **kwargs):
        return shard_batch(batch, cp_size=cp_size, cp_rank=cp_rank, load_balance=False, **kwargs)

    return broken


def _pad_with_targets(pad_rows):
    """Negative control: the rows padding a ragged pipeline batch keep targets (token 0 -> 0)."""

    def broken(input_ids, labels, mask, positions, rows):
        ids, padded, mask, positions = pad_rows(input_ids, labels, mask, positions, rows)
        padded[labels.shape[0]:] = 0
        return ids, padded, mask, positions

    return broken


def _per_rank_router_statistics(global_loss):
    """Negative control: the load-balancing loss from this rank's router statistics only (the
    sums over the data-parallel ranks left out: transformers' per-rank value)."""

    def broken(*args, group=None, **kwargs):
        return global_loss(*args, **kwargs)

    return broken


BROKEN = {
    "per_rank_router_statistics": (load_balancing, "global_load_balancing_loss", _per_rank_router_statistics),
    "per_rank_count": (schedule, "global_target_count", lambda saved: _per_rank_count),
    "cut_without_load_balance": (sharding, "shard_batch", _cut_without_load_balance),
    "pad_with_targets": (schedule, "_pad_rows", _pad_with_targets),
}


class _Broken:
    """Swap one of smp's functions for its broken variant (BROKEN) for the length of a case."""

    def __init__(self, name: str | None):
        self.entry = BROKEN.get(name) if name else None

    def __enter__(self):
        if self.entry:
            module, attr, make = self.entry
            self.saved = getattr(module, attr)
            setattr(module, attr, make(self.saved))

    def __exit__(self, *exc):
        if self.entry:
            module, attr, _ = self.entry
            setattr(module, attr, self.saved)


def _grad_diff(model, reference) -> float:
    ref = dict(reference.named_parameters())
    # A gradient that never arrived counts as an infinite difference.
    return max(float("inf") if p.grad is None else float((full_tensor(p.grad) - ref[n].grad).abs().max())
               for n, p in model.named_parameters())


def _reference_loss(reference, batch: dict) -> torch.Tensor:
    """The one-process loss: a transformers model's own; for a plain model (logits out, no mask
    in its batch) the mean next-token cross-entropy over the non-ignored targets."""
    if not isinstance(reference, TinyTransformer):
        return reference(**batch).loss
    logits = reference(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE)


def token_sum_loss(outputs, batch: dict) -> torch.Tensor:
    """A user's loss_fn that weighs every target of the global batch alike: its summed token
    losses over the batch's `num_items_in_batch` (context parallel: labels already shifted)."""
    if "shift_labels" in batch:
        logits, targets = outputs.logits, batch["shift_labels"]
    else:
        logits, targets = outputs.logits[:, :-1], batch["labels"][:, 1:]
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / batch["num_items_in_batch"]


def with_router_loss(model):
    """A MoE model whose loss includes its load-balancing term (config.output_router_logits)."""
    model.config.output_router_logits = True
    model.router_aux_loss_coef = model.config.router_aux_loss_coef = AUX_COEF
    return model


def equivalence(config: dict, kind: str = "llama", steps: int = 2, broken: str | None = None,
                layers: int = 2, loss_fn: str | None = None, router_loss: bool = False) -> dict:
    """The same loop under `config` and in one process on the same init and global batches:
    `smp.step` + SGD for `steps` steps, `smp.evaluate` on held-out rows after each. The largest
    loss (every rank's returned value), gradient and evaluation differences. `router_loss`: a
    MoE model's loss includes its load-balancing term (`aux`: the one-process values)."""
    with _Broken(broken), smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = tiny_model(kind, layers=layers)
        if router_loss:
            with_router_loss(reference)
        model = smp.transform(copy.deepcopy(reference))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "eval_diff": 0.0, "losses": [], "aux": []}
        for i in range(steps):
            batch, held_out = padded_batch(seed=100), padded_batch(seed=7 + i)  # one batch: the loss falls
            if kind == "plain":  # a user's module takes no mask: the labels alone mark the padding
                batch.pop("attention_mask"), held_out.pop("attention_mask")
            loss = smp.step(model, data_rows(batch), loss_fn=LOSS_FNS[loss_fn])  # the loop every layout runs
            if router_loss:
                with torch.no_grad():
                    report["aux"].append(float(reference(**batch).aux_loss))
            ref_loss = _reference_loss(reference, batch)
            ref_loss.backward()
            ref_loss = ref_loss.detach()
            report["losses"].append(float(ref_loss))
            report["loss_diff"] = max(report["loss_diff"], abs(float(loss) - float(ref_loss)))
            report["grad_diff"] = max(report["grad_diff"], _grad_diff(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            with torch.no_grad():
                ref_eval = float(_reference_loss(reference, held_out))
            evaluated = smp.evaluate(model, data_rows(held_out), loss_fn=LOSS_FNS[loss_fn])
            report["eval_diff"] = max(report["eval_diff"], abs(float(evaluated) - ref_eval))
        return report


LOSS_FNS = {None: None, "token_sum": token_sum_loss}


def accumulation(config: dict) -> dict:
    """Two half batches with `accumulate=True` / `scale=0.5` then one plain step vs one process
    on the three halves' mean gradient; and the same through `smp.no_sync`."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = tiny_model("llama", layers=2)
        model = smp.transform(copy.deepcopy(reference))
        halves = [padded_batch(seed=100 + i) for i in range(2)]
        expected = sum(reference(**half).loss for half in halves) / 2
        expected.backward()
        smp.step(model, data_rows(halves[0]), scale=0.5, accumulate=True)
        smp.step(model, data_rows(halves[1]), scale=0.5)
        report = {"grad_diff": _grad_diff(model, reference)}
        model.zero_grad()
        with smp.no_sync(model):
            smp.step(model, data_rows(halves[0]), scale=0.5)
        smp.step(model, data_rows(halves[1]), scale=0.5)
        report["no_sync_grad_diff"] = _grad_diff(model, reference)
        return report


def pipelined_call(config: dict, steps: int = 2) -> dict:
    """A loop written for the whole model (Hugging Face's run_clm_no_trainer: `outputs =
    model(**batch); outputs.loss.backward()`, evaluation under no_grad) on a pipelined model vs
    one process; then a ragged evaluation batch (1 row, 2 micro-batches) and what is refused."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = tiny_model("llama", layers=2)
        model = smp.transform(copy.deepcopy(reference))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "eval_diff": 0.0}
        for i in range(steps):
            batch, held_out = padded_batch(seed=100 + i), padded_batch(seed=7 + i)
            outputs = model(**batch)
            outputs.loss.backward()  # does nothing more: the call ran the backward
            ref_loss = reference(**batch).loss
            ref_loss.backward()
            report["loss_diff"] = max(report["loss_diff"], abs(float(outputs.loss) - float(ref_loss.detach())))
            report["grad_diff"] = max(report["grad_diff"], _grad_diff(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            model.eval(), reference.eval()
            with torch.no_grad():
                diff = abs(float(model(**held_out).loss) - float(reference(**held_out).loss))
            report["eval_diff"] = max(report["eval_diff"], diff)
            model.train(), reference.train()
        report.update(ragged(model, reference))
        report["errors"] = _call_errors(model, padded_batch(seed=5))
        return report


def ragged(model, reference) -> dict:
    """Evaluation of batches whose rows do not split into the micro-batches (1 and 3 rows)."""
    out = {"ragged_diff": 0.0}
    for rows in (1, 3):
        batch = padded_batch(seed=11, rows=rows)
        with torch.no_grad():
            expected = float(reference(**batch).loss)
            out["ragged_diff"] = max(out["ragged_diff"], abs(float(smp.evaluate(model, batch)) - expected),
                                     abs(float(model(**batch).loss) - expected))
    return out


def ragged_eval(config: dict, broken: str | None = None) -> dict:
    """`ragged` alone, on a fresh pipelined model (for the negative control)."""
    with _Broken(broken), smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = tiny_model("llama", layers=2)
        model = smp.transform(copy.deepcopy(reference))
        return ragged(model, reference)


def _call_errors(model, batch: dict) -> dict:
    def error(attempt) -> str:
        try:
            attempt()
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""

    def twice():
        loss = model(**batch).loss
        loss.backward()
        loss.backward()

    out = {"no_labels": error(lambda: model(input_ids=batch["input_ids"])),
           "twice": error(twice),
           "scaled": error(lambda: (model(**batch).loss / 2).backward())}
    model.zero_grad()
    return out


def step_errors(config: dict, kind: str = "llama", router_loss: str | None = None) -> dict:
    """What smp.step says to what it cannot make equal to one process, on this rank.
    `router_loss`: a MoE model's load-balancing loss turned on "before" smp.transform, or
    "after" it (where smp.transform would have refused it)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = original = tiny_model(kind, layers=2)
        if router_loss == "before":
            with_router_loss(model)
        model = smp.transform(model)
        if router_loss == "after":  # a pipelined model's stages share the original model's config
            with_router_loss(original)
        batch = data_rows(padded_batch(seed=5))

        def error(extra: dict) -> str:
            try:
                smp.step(model, {**batch, **extra})
            except smp.Error as e:
                return f"{type(e).__name__}: {e}"
            return ""

        packed = torch.arange(SEQ).remainder(8).expand_as(batch["input_ids"])
        out = {"plain": error({}), "unknown_key": error({"token_type_ids": torch.zeros_like(batch["input_ids"])}),
               "packed_positions": error({"position_ids": packed})}
        if router_loss:  # as if smp.transform had not summed the router statistics over the ranks
            summed = model.__dict__.pop("_smp_load_balancing", None)
            out["not_summed"] = error({})
            model._smp_load_balancing = summed
        return out


def packed_step_vs_documents(family: str, use_cache: bool | None = None) -> dict:
    """smp.step at world 1 on packed rows (positions restarting at each document, no mask) vs
    the same model's documents run one by one: loss and gradients. GraniteMoE's causal LM takes
    `use_cache` only through **kwargs, and with its config's default (on) transformers builds a
    cache and attends across the documents. `use_cache` set: the batch carries it (the
    negative control passes True)."""
    from tests.models.model_coverage_cases import build_family
    from tests.training.packed_cases import documents_of, packed_batch

    torch.manual_seed(0)
    reference = build_family(family)
    model = copy.deepcopy(reference)
    batch = packed_batch()
    targets = int((sharding.shift_labels(batch["labels"]) != IGNORE).sum())
    expected = 0.0
    for doc in documents_of(batch):
        loss = reference(input_ids=doc[None], labels=doc[None], use_cache=False).loss * (len(doc) - 1) / targets
        loss.backward()
        expected += float(loss.detach())
    if use_cache is not None:
        batch = {**batch, "use_cache": use_cache}
    with smp.session({}):
        model = smp.transform(model)
        got = float(smp.step(model, batch))
        grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": abs(got - expected),
            "grads": max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters())}
