"""Pipeline parallelism in the plan: what a schedule makes each rank hold and send, read from the
schedule's own order of actions.

The multi-stage schedules (interleaved, looped BFS, zero bubble, V) are built by torch with their
order for every rank (`pipeline_order`: forward F, full backward B, input-gradient I,
weight-gradient W of (stage, micro-batch)); smp plans from that order, so a plan follows what the
run executes. For GPipe and 1F1B torch runs a loop instead of a table; `single_stage_order`
writes that loop's order (GPipe: all forwards, then all backwards; 1F1B: rank r starts with
min(m, p - r) forwards, then alternates backward and forward).

From an order:
  held micro-batches   a stage's activations live from its F to its B (or W, for the
                       split-backward schedules, which hold more than this in a real run:
                       tests/planning/test_planning_pp.py reports by how much)
  point-to-point bytes an F sends the stage's output to the next stage, a B / I sends the input
                       gradient to the previous stage, when that stage is on another rank:
                       2 x m x (rows per micro-batch x seq x hidden x bytes) per boundary between ranks
  bubble fraction      the ranks run their orders with unit costs T_F = T_I = T_W = 1 (T_B = 2),
                       each action waiting for the one it depends on; bubble = idle / step.
                       For GPipe and 1F1B this is (p-1)/(m+p-1) (GPipe, Huang et al. 2019), for
                       interleaved 1F1B (p-1)/(v m+p-1) (Narayanan et al. 2021), checked in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

COMPUTE = ("F", "B", "I", "W")
COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # the zero-bubble paper's T_F = T_B(input) = T_W


@dataclass(frozen=True)
class Act:
    """One compute action of a schedule: kind F / B / I / W, stage index, micro-batch index."""

    kind: str
    stage: int
    mb: int


def single_stage_order(schedule: str, pp: int, microbatches: int) -> dict[int, list[Act]]:
    """The order torch's ScheduleGPipe / Schedule1F1B run on each rank (stage r on rank r)."""
    order: dict[int, list[Act]] = {}
    for r in range(pp):
        if schedule == "gpipe":
            acts = [Act("F", r, i) for i in range(microbatches)] + [Act("B", r, i) for i in range(microbatches)]
        elif schedule == "1f1b":
            warmup = min(microbatches, pp - r)
            acts = [Act("F", r, i) for i in range(warmup)]
            for i in range(microbatches):
                acts.append(Act("B", r, i))
                if warmup + i < microbatches:
                    acts.append(Act("F", r, warmup + i))
        else:
            raise ValueError(f"{schedule!r} is not a one-stage-per-rank schedule")
        order[r] = acts
    return order


def torch_order(pipeline_order: dict[int, list[Any]]) -> dict[int, list[Act]]:
    """A torch schedule's `pipeline_order` as compute actions (idle slots, communication and
    gradient-reduction entries dropped; an overlapped F + B pair as its two actions)."""

    def flatten(action: Any) -> Iterable[Act]:
        if action is None:
            return
        subs = getattr(action, "sub_actions", None)
        if subs:
            for sub in subs:
                yield from flatten(sub)
            return
        kind = getattr(action.computation_type, "value", str(action.computation_type))
        if kind in COMPUTE:
            yield Act(kind, action.stage_index, action.microbatch_index)

    return {rank: [a for action in actions for a in flatten(action)] for rank, actions in pipeline_order.items()}


def held_activation_peak(acts: list[Act], bytes_per_mb: dict[int, int]) -> tuple[int, dict[int, int]]:
    """(peak bytes, most micro-batches held at once per stage) of one rank's order: a stage's
    activations of a micro-batch are held from its F to its B (or its W)."""
    live: dict[tuple[int, int], int] = {}
    held: dict[int, int] = {}
    most: dict[int, int] = {}
    current = peak = 0
    for a in acts:
        key = (a.stage, a.mb)
        if a.kind == "F":
            live[key] = bytes_per_mb.get(a.stage, 0)
            current += live[key]
            held[a.stage] = held.get(a.stage, 0) + 1
            most[a.stage] = max(most.get(a.stage, 0), held[a.stage])
            peak = max(peak, current)
        elif a.kind in ("B", "W") and key in live:
            current -= live.pop(key)
            held[a.stage] -= 1
    return peak, most


def p2p_bytes(order: dict[int, list[Act]], owner: dict[int, int], act_bytes: int) -> dict[int, dict[str, int]]:
    """Bytes each rank sends and receives per step: an activation per F whose next stage is on
    another rank, an input gradient per B / I whose previous stage is (each `act_bytes`)."""
    out = {r: {"send": 0, "recv": 0} for r in order}
    last = max(owner)
    for rank, acts in order.items():
        for a in acts:
            peer = None
            if a.kind == "F" and a.stage < last:
                peer = owner[a.stage + 1]
            elif a.kind in ("B", "I") and a.stage > 0:
                peer = owner[a.stage - 1]
            if peer is not None and peer != rank:
                out[rank]["send"] += act_bytes
                out[peer]["recv"] += act_bytes
    return out


def simulate(order: dict[int, list[Act]], cost: dict[str, float] = COST) -> dict[str, Any]:
    """Run every rank's order with `cost` per action, each waiting for its dependency (F after
    the previous stage's F, B / I after the next stage's B / I or the last stage's own F, W after
    its I); returns the step time and each rank's bubble fraction (idle / step)."""
    last = max(a.stage for acts in order.values() for a in acts)
    done: dict[tuple[str, int, int], float] = {}
    pos = {r: 0 for r in order}
    clock = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}

    def ready(a: Act) -> float | None:
        if a.kind == "F":
            dep = ("F", a.stage - 1, a.mb) if a.stage > 0 else None
        elif a.kind in ("B", "I"):
            dep = ("F", a.stage, a.mb) if a.stage == last else None
            if dep is None:
                nxt = done.get(("B", a.stage + 1, a.mb), done.get(("I", a.stage + 1, a.mb)))
                return nxt
        else:
            dep = ("I", a.stage, a.mb)
        return 0.0 if dep is None else done.get(dep)

    remaining = sum(len(v) for v in order.values())
    while remaining:
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = ready(a)
                if t is None:
                    break
                start = max(clock[r], t)
                clock[r] = start + cost[a.kind]
                busy[r] += cost[a.kind]
                done[(a.kind, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule's order waits on an action no rank runs")
    step = max(clock.values())
    return {"step": step, "bubble": {r: 1 - busy[r] / step for r in order}}


def bubble_formula(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[float | None, str]:
    """The closed-form bubble fraction of `schedule` and where it comes from; None where smp
    knows no closed form (zero-bubble and V schedules: the simulated order's figure stands)."""
    p, m, v = pp, microbatches, stages_per_rank
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1) (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021)"
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1) (interleaved 1F1B, Narayanan et al. 2021)"
    return None, "no closed form used: the simulated order under T_F = T_I = T_W (zero-bubble paper, Qi et al. 2024)"


# ----------------------------------------------------------------------------------------------
# The plan of one rank


def plan_stages(model: Any, cfg: Any, pp_group: Any, pp_rank: int, *, rows: int, seq_len: int, hidden: int,
                compute_bytes: int | None, recipe: Any) -> dict[str, Any]:
    """Split the (meta) `model` as `smp.transform` does, pass this rank's stages through
    `recipe` (the rest of smp's parallelism, left on meta), build the configured torch schedule
    over them, and read from it what each rank holds and sends.

    rows: sequences per pipeline micro-batch. Returns the figures and the transformed stages.
    """
    import torch
    import torch.nn.functional as F

    from smp.config import SINGLE_STAGE_SCHEDULES
    from smp.pipeline import build_pipeline
    from smp.pipeline.schedule import IGNORE_INDEX
    from smp.planning.activations import saved_activation_bytes
    from smp.sharding import find_blocks

    pipe = cfg.pipeline
    per_mb: dict[int, dict[str, Any]] = {}

    def count_then_apply(stage: Any) -> Any:
        info = stage._smp_stage[0]  # (StageInfo, ModelParts), set by build_stage_module
        blocks = find_blocks(stage, cfg.shard_modules)
        ids = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
        x = ids if info.first else torch.zeros(rows, seq_len, hidden, device="meta", requires_grad=True)

        def run() -> Any:
            out = _stage_forward_on_meta(stage, x)
            if info.last:  # the loss PipelinedModel applies on the last stage, per micro-batch
                out = F.cross_entropy(out[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                      ignore_index=IGNORE_INDEX, reduction="sum")
            return out

        outside, per_block = saved_activation_bytes(stage, rows, seq_len, blocks, compute_bytes, run=run)
        per_mb[info.index] = {"outside": outside, "per_block": per_block}
        return recipe(stage)

    pipelined = build_pipeline(model, pipe, pp_group, torch.device("cpu"), count_then_apply)
    pp = pp_group.size()
    num_stages = len(pipelined.split)
    microbatches = pipe.microbatches or pp * len(pipelined.stages)
    if pipe.schedule in SINGLE_STAGE_SCHEDULES:
        order = single_stage_order(pipe.schedule, pp, microbatches)
    else:
        order = torch_order(pipelined._build_schedule(microbatches).pipeline_order)
    owner = {a.stage: r for r, acts in order.items() for a in acts}
    act_bytes = rows * seq_len * hidden * (compute_bytes or 4)  # a stage's output = the next one's input
    return {
        "pipelined": pipelined, "order": order, "owner": owner, "per_mb": per_mb,
        "microbatches": microbatches, "num_stages": num_stages, "boundary_bytes": act_bytes,
        "p2p": p2p_bytes(order, owner, act_bytes), "simulated": simulate(order),
        "formula": bubble_formula(pipe.schedule, pp, microbatches, num_stages // pp),
    }


def _stage_forward_on_meta(stage: Any, x: Any) -> Any:
    """The stage's forward (smp/pipeline/split.py) with use_cache=True for a transformers model:
    without a cache transformers inspects position ids for packed sequences with a
    data-dependent branch, which meta tensors cannot take (the cache saves nothing for backward)."""
    info, parts = stage._smp_stage
    if not parts.hf:
        return stage(x)
    inputs = {"input_ids": x} if info.first else {"inputs_embeds": x}
    if info.last:
        return type(stage).forward(stage, **inputs, use_cache=True).logits
    return stage.get_submodule(parts.layers.rsplit(".", 1)[0])(**inputs, use_cache=True).last_hidden_state
