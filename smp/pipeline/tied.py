"""Tied parameters across pipeline stages: one tensor the model uses under two names that land
on different stages (tie_word_embeddings: the input embedding on the first stage, the LM head on
the last).

Each stage keeps its own copy (a rank holding both stages of a tie shares one tensor, as the
model does). The copies start equal (they are the model's one tensor, or filled from it) and
stay equal: after the schedule's backward, `sum_tied_grads` gives every copy the sum of the
gradients of all copies (one exchange between the two pipeline ranks holding them), which is
the gradient one process computes for the one tensor; identical gradients then give identical
optimizer updates. `norm_skip` names the copies a global gradient norm must not count twice.

A tie spread over more than two pipeline ranks, or whose copies have different layouts (local
shard shape, placements), is refused with the reason at build time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from smp.errors import ConfigError


@dataclass(frozen=True)
class TiedGroup:
    """The names of one tied tensor and the pipeline ranks whose stages hold any of them."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]  # pipeline ranks (in the pp group), ascending; 1 or 2 of them
    source: str  # the name whose value the model keeps (the embedding, not the head that reuses it)


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter `model` uses under two or more names, in model order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def held(stages: Sequence[nn.Module], names: Sequence[str]) -> list[nn.Parameter]:
    """The distinct parameters `stages` hold under any of `names` (a tensor two local stages
    share counts once)."""
    found: dict[int, nn.Parameter] = {}
    for stage in stages:
        for name in names:
            try:
                p = stage.get_parameter(name)
            except (AttributeError, TypeError):
                continue
            found.setdefault(id(p), p)
    return list(found.values())


def _layout(p: torch.Tensor) -> str:
    if isinstance(p, DTensor):
        return f"local shape {tuple(p.to_local().shape)}, placements {tuple(p.placements)}, mesh {tuple(p.device_mesh.shape)}"
    return f"shape {tuple(p.shape)}, not sharded"


def plan_ties(model_names: list[tuple[str, ...]], stages: Sequence[nn.Module],
              pp_group: dist.ProcessGroup, targets: set[str] = frozenset()) -> list[TiedGroup]:
    """The tied groups whose names land on different pipeline ranks, after checking on every
    rank (one all_gather over the pipeline ranks) that their copies can be summed exactly:
    at most two ranks hold copies, and every copy has the same layout. Called once, after the
    stages went through the rest of smp's parallelism (FSDP, TP). `targets`: names transformers
    ties to another (`all_tied_weights_keys`: the head), never a group's source."""
    mine = [[_layout(p) for p in held(stages, names)] for names in model_names]
    everyone: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, mine, group=pp_group)
    groups = []
    for g, names in enumerate(model_names):
        ranks = tuple(r for r, layouts in enumerate(everyone) if layouts[g])
        layouts = sorted({layout for r in ranks for layout in everyone[r][g]})
        if len(ranks) > 2:
            raise ConfigError(
                f"{' / '.join(names)} is one tied tensor used on the stages of pipeline ranks {list(ranks)}; smp "
                f"sums a tied parameter's gradients between two pipeline ranks only. Untie it (e.g. "
                f"config.tie_word_embeddings=False before building the model) or change pipeline.split"
            )
        if len(layouts) > 1:
            raise ConfigError(
                f"{' / '.join(names)} is one tied tensor whose copies on different pipeline stages are laid out "
                f"differently ({'; '.join(layouts)}), so their gradients cannot be summed shard by shard. Give "
                f"both modules the same tensor-parallel style (or none), or untie it (e.g. "
                f"config.tie_word_embeddings=False before building the model)"
            )
        if len(ranks) == 2 or len(held(stages, names)) > 1:
            groups.append(TiedGroup(names, ranks, next((n for n in names if n not in targets), names[0])))
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sum_tied_grads(groups: Sequence[TiedGroup], stages: Sequence[nn.Module], pp_group: dist.ProcessGroup,
                   before: dict[int, torch.Tensor | None]) -> None:
    """Give every copy of each tied tensor the sum of all copies' gradients of this step, plus
    what it held before the step (`before`: param id -> gradient set aside by `set_aside`).
    Only the ranks holding copies take part (point-to-point between the two)."""
    me = dist.get_rank(pp_group)
    for group in groups:
        params = held(stages, group.names)
        if not params:
            continue
        grads = [p.grad for p in params]
        template = next((g for g in grads if g is not None), None)
        total = torch.zeros_like(_local(params[0])) if template is None else torch.zeros_like(_local(template))
        for g in grads:  # copies on this rank (V / interleaved: each stage its own, e.g. under FSDP)
            if g is not None:
                total += _local(g)
        peers = [r for r in group.ranks if r != me]
        if peers:
            peer = dist.get_global_rank(pp_group, peers[0])
            received = torch.empty_like(total)
            ops = [dist.P2POp(dist.isend, total, peer, pp_group), dist.P2POp(dist.irecv, received, peer, pp_group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            # Addition in IEEE arithmetic is commutative: both ranks get the same bits.
            total = total + received
        for p in params:
            value = total if before.get(id(p)) is None else _local(before[id(p)]) + total
            if p.grad is None:
                p.grad = (DTensor.from_local(value.clone(), p.device_mesh, p.placements, run_check=False)
                          if isinstance(p, DTensor) else value.clone())
            else:
                _local(p.grad).copy_(value)


def set_aside(groups: Sequence[TiedGroup], stages: Sequence[nn.Module]) -> dict[int, torch.Tensor | None]:
    """Before a step: take the gradients the tied copies already hold (accumulation over steps
    without zero_grad) so that only this step's are summed; `sum_tied_grads` adds them back."""
    before: dict[int, torch.Tensor | None] = {}
    for group in groups:
        for p in held(stages, group.names):
            before[id(p)] = p.grad
            p.grad = None
    return before


def norm_skip(groups: Sequence[TiedGroup], stages: Sequence[nn.Module], pp_group: dist.ProcessGroup) -> set[int]:
    """Ids of the tied copies a norm over every pipeline rank must leave out: after the sum all
    copies hold the same gradient, counted once, on the lowest rank holding a copy."""
    me = dist.get_rank(pp_group)
    skip: set[int] = set()
    for group in groups:
        params = held(stages, group.names)
        keep = 1 if group.ranks and me == group.ranks[0] else 0
        skip.update(id(p) for p in params[keep:])
    return skip


@torch.no_grad()
def copy_tied_values(groups: Sequence[TiedGroup], stages: Sequence[nn.Module], pp_group: dist.ProcessGroup) -> None:
    """Give every copy of each tied tensor the value of its source (after per-stage init, which
    initialises the head's copy as an untied head): the rank holding the source sends it to the
    other holder; copies on one rank are copied locally."""
    me = dist.get_rank(pp_group)
    for group in groups:
        params = held(stages, group.names)
        if not params:
            continue
        source = held(stages, [group.source])
        peers = [r for r in group.ranks if r != me]
        if peers:
            peer = dist.get_global_rank(pp_group, peers[0])
            if source:
                dist.send(_local(source[0]).contiguous(), peer, group=pp_group)
            else:
                value = torch.empty_like(_local(params[0]))
                dist.recv(value, peer, group=pp_group)
                source = [params[0]]
                _local(params[0]).copy_(value)
        for p in params:
            if p is not source[0]:
                _local(p).copy_(_local(source[0]))
