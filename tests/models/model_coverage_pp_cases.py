"""The model-coverage matrix's pipeline column (mode "pp2"): each family's tiny model split into
2 pipeline stages (world 2, 1F1B, 4 micro-batches) and trained with `smp.pipeline.step`, vs
the same model in one process on the same global batch: loss and every gradient within 1e-5
over 2 SGD steps. A family smp cannot split is "refused" with smp's reason.

tests/models/model_coverage_cases.py imports this module (its CASE_FUNCTIONS), so this one reaches it
inside the functions, not at import.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist

import smp
import smp.pipeline
from smp.testing.distributed import local_rows
from smp.testing.models import random_batch

# The column's config: pp 2 with torch's 1F1B schedule over 4 micro-batches (1 row each of the
# matrix's global batch of 4).
PP2 = {"pipeline_parallel_degree": 2, "pipeline": {"schedule": "1f1b", "microbatches": 4}}


def equivalence(config: dict, family: str, steps: int = 2, drop_microbatch_scale: bool = False) -> dict:
    """`family` pipelined under `config` vs one process (same init, same global batch, `steps`
    SGD steps): the largest loss and gradient gaps and the parameter names each rank held.
    `drop_microbatch_scale` (the negative control) trains with a per-micro-batch mean loss not
    divided by the micro-batch count, which the comparison must catch."""
    from tests.models import model_coverage_cases as coverage

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = coverage.build_family(family)
        reference.train()
        eval_mode = coverage.training_forward_is_random(copy.deepcopy(reference))
        if eval_mode:
            reference.eval()
        model = smp.transform(copy.deepcopy(reference))
        model.train(reference.training)
        loss_fn = None
        if drop_microbatch_scale:
            import torch.nn.functional as F

            microbatches = model.pipe.microbatches

            def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                mean = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
                return mean * microbatches  # smp divides by the count: this undoes it

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        batch = random_batch(coverage.GLOBAL_BATCH, coverage.SEQ, coverage.VOCAB, seed=100)
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "eval_mode": eval_mode}
        for _ in range(steps):
            loss = smp.pipeline.step(model, local_rows(batch), loss_fn=loss_fn)
            ref_loss = coverage.loss_of(reference, batch)
            ref_loss.backward()
            report["losses"].append(float(ref_loss.detach()))
            report["loss_diff"] = max(report["loss_diff"], abs(float(loss) - float(ref_loss.detach())))
            report["grad_diff"] = max(report["grad_diff"], coverage._grad_diff(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, sorted(n for n, _ in model.named_parameters()))
        report["held"] = held
        report["names"] = sorted(n for n, _ in reference.named_parameters(remove_duplicate=False))  # tied: both names
        return report


def _unsplit(report: dict) -> str:
    """Why an exact-looking cell proves nothing about the pipeline ('' when it does): every
    parameter must be on exactly one stage and each stage must hold some."""
    held, names = report["held"], report["names"]
    if any(not h for h in held):
        return "a pipeline rank held no parameter: the model was not split"
    everything = [n for h in held for n in h]
    if sorted(everything) != names:
        return "the stages do not hold each parameter of the model exactly once"
    return ""


def classify(config: dict, family: str) -> dict:
    """One pp 2 coverage cell, statuses as model_coverage_cases.classify's: exact | refused
    (smp raised one of its errors; the message is the reason) | unproven | mismatch | crash."""
    from tests.models import model_coverage_cases as coverage

    try:
        report = equivalence(config, family)
    except smp.Error as e:
        return {"status": "refused", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        return {"status": "crash", "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    exact = report["loss_diff"] < coverage.TOL and report["grad_diff"] < coverage.TOL
    unsplit = _unsplit(report)
    if exact and unsplit:
        return {"status": "unproven", "detail": unsplit}
    detail = {k: report[k] for k in ("loss_diff", "grad_diff", "eval_mode")}
    cell = {"status": "exact" if exact else "mismatch", "detail": detail}
    if report["eval_mode"]:
        cell["note"] = "eval mode: its training forward draws random numbers (sampled routing)"
    return cell
