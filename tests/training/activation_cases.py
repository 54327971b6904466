"""Activation checkpointing / offloading cases. `run_modes` runs on every rank of a RankPool;
`single_process_run` runs in the test process (no process group: the apply_* functions alone).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import smp
from smp.activations import apply_activation_checkpointing, apply_activation_offloading
from smp.activations.accounting import OpCounter, SavedActivationMeter, parameter_ptrs
from smp.activations.offloading import offload_stats
from smp.config import load_config
from smp.sharding import find_blocks
from smp.testing.distributed import full_tensor
from smp.testing.models import TinyTransformer, loss_of, random_batch, tiny_llama

GLOBAL_BATCH, SEQ, LAYERS = 4, 16, 4
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm")


def apply_activations(model: torch.nn.Module, blocks: list[torch.nn.Module], cfg) -> None:
    """The activation steps of smp.transform alone (no FSDP), with the config unpacked as there."""
    ac = cfg.activation_checkpointing
    apply_activation_checkpointing(model, blocks, mode=ac.mode, every_n_layers=ac.every_n_layers, save_ops=ac.save_ops)
    if cfg.activation_offloading:
        apply_activation_offloading(
            model, blocks, horizon=cfg.activation_loading_horizon, min_bytes=cfg.activation_offload_min_bytes
        )


def build(kind: str, layers: int = LAYERS) -> torch.nn.Module:
    if kind == "plain":
        return TinyTransformer(layers=layers)
    return tiny_llama(num_hidden_layers=layers, use_cache=False)


def _vocab(kind: str) -> int:
    return 128 if kind == "plain" else 256


def _measured_step(model, blocks, batch) -> dict:
    """One forward + backward with the meters on; returns loss, grads and the measurements."""
    offloader = getattr(model, "_smp_activation_offloader", None)
    if offloader is not None:
        offloader.stats.reset()
    with SavedActivationMeter(blocks) as meter:
        loss = loss_of(model, batch)
    exclude = parameter_ptrs(model) | (offloader.host_storage_ptrs() if offloader else set())
    live = meter.live_bytes(exclude)
    with OpCounter() as counter:
        loss.backward()
    stats = offload_stats(model)
    return dict(
        loss=loss.detach(),
        grads={n: full_tensor(p.grad).clone() for n, p in model.named_parameters()},
        live_per_layer=live.per_layer,
        backward_matmuls=sum(counter.counts[op] for op in MATMULS),
        backward_ops=dict(counter.counts),
        stats=None if stats is None else dict(
            saved_bytes=list(stats.saved_bytes), offloaded_bytes=list(stats.offloaded_bytes),
            resident_bytes=stats.resident_bytes, max_layers_resident=stats.max_layers_resident,
            prefetch_loads=stats.prefetch_loads, demand_loads=stats.demand_loads,
        ),
    )


def _compare(result: dict, baseline: dict) -> dict:
    diffs = [float((result["grads"][n] - g).abs().max()) for n, g in baseline["grads"].items()]
    return dict(
        grads_bitwise=all(torch.equal(result["grads"][n], g) for n, g in baseline["grads"].items()),
        grad_diff=max(diffs),
        loss_bitwise=torch.equal(result["loss"], baseline["loss"]),
    )


def single_process_run(kind: str, configs: list[dict], layers: int = LAYERS, mutate=None) -> list[dict]:
    """Each config applied (checkpointing, offloading; no FSDP) to the same model and batch.

    Results are compared with the first config's. `mutate(model)` runs after the apply steps
    (negative checks: break something and see the measurement notice).
    """
    torch.manual_seed(0)
    reference = build(kind, layers)
    batch = random_batch(GLOBAL_BATCH, SEQ, _vocab(kind), seed=3)
    results = []
    for raw in configs:
        cfg = load_config(raw)
        model = copy.deepcopy(reference)
        blocks = find_blocks(model)
        apply_activations(model, blocks, cfg)
        if mutate is not None:
            mutate(model)
        result = _measured_step(model, blocks, batch)
        result["state_dict_keys"] = sorted(model.state_dict())
        results.append(result)
    for result in results:
        result.update(_compare(result, results[0]))
    return results


def run_modes(base: dict, modes: list[dict], kind: str, steps: int = 2) -> list[dict]:
    """smp.transform with `base | mode` for each mode, on this rank's rows of one global batch.

    Each mode is compared with the first (bitwise expected: same sharding, same math) and with
    the single-process run of the untransformed model on the whole batch (tolerance: FSDP's
    reduction order). Returns, per mode, the worst differences over `steps` SGD steps and the
    last step's measurements.
    """
    batch = random_batch(GLOBAL_BATCH, SEQ, _vocab(kind), seed=5)
    runs = []
    for mode in modes:
        with smp.session({**base, **mode}):
            torch.manual_seed(smp.state.config.random_seed)
            reference = build(kind)
            model = smp.transform(copy.deepcopy(reference))
            blocks = find_blocks(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            per = GLOBAL_BATCH // smp.state.dp_size
            rows = batch[smp.state.dp_rank * per:(smp.state.dp_rank + 1) * per]
            steps_out = []
            for _ in range(steps):
                result = _measured_step(model, blocks, rows)
                ref_loss = loss_of(reference, batch)
                ref_loss.backward()
                loss = result["loss"].double().clone()
                dist.all_reduce(loss)
                result["loss_vs_single"] = abs(float(loss) / dist.get_world_size() - float(ref_loss))
                ref_grads = dict(reference.named_parameters())
                result["grad_vs_single"] = max(
                    float((g - ref_grads[n].grad).abs().max()) for n, g in result["grads"].items()
                )
                steps_out.append(result)
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
            runs.append(steps_out)
    reports = []
    for steps_out in runs:
        comparisons = [_compare(r, b) for r, b in zip(steps_out, runs[0])]
        last = steps_out[-1]
        reports.append(dict(
            grads_bitwise=all(c["grads_bitwise"] for c in comparisons),
            loss_bitwise=all(c["loss_bitwise"] for c in comparisons),
            grad_diff=max(c["grad_diff"] for c in comparisons),
            loss_vs_single=max(r["loss_vs_single"] for r in steps_out),
            grad_vs_single=max(r["grad_vs_single"] for r in steps_out),
            live_per_layer=last["live_per_layer"], backward_matmuls=last["backward_matmuls"],
            stats=last["stats"],
        ))
    return reports
