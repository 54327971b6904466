"""Split a model into pipeline stages: which layers each stage holds, and the stage modules.

A stage module is the user's model with the parts it does not own removed: decoder layers of
other stages become parameter-free pass-throughs (so the layer loop keeps its indices), the
embedding is dropped on every stage but the first, the final norm becomes an identity and the
head is dropped on every stage but the last. Parameter and buffer names are those of the whole
model, so a stage's state_dict is a slice of the model's.

The forward of a stage is the model's own code: for a transformers causal LM the base model's
forward (with `inputs_embeds` = the received hidden state on every stage but the first), and
on the last stage the causal LM's forward, which applies the head (and any logit soft-capping).
Rotary embeddings, masks and position ids are computed the way the model computes them, on
every stage. `check_layer_chain` proves, before anything runs, that the model's forward is a
plain chain through its layers; a family whose forward does anything else between its
embedding and its first layer, or between layers, is refused with the reason.

A plain nn.Module qualifies when its forward applies its children in registration order, one
of them an nn.ModuleList of blocks (checked the same way).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from smp._compat import own_children
from smp.anatomy import Anatomy, PipelineParts, describe, is_norm
from smp.errors import ConfigError


@dataclass(frozen=True)
class StageInfo:
    """One stage: its index, the layer indices it holds, and its cost (for balance reports)."""

    index: int
    layers: range
    params: int
    flops_per_token: int  # forward, 2 x multiply-adds of its matmul weights (attention scores not counted)
    first: bool
    last: bool

    def describe(self) -> str:
        parts = (["embedding"] if self.first else []) + [
            f"layers {self.layers.start}-{self.layers.stop - 1}" if len(self.layers) > 1 else f"layer {self.layers.start}"
        ] + (["norm + head"] if self.last else [])
        return f"stage {self.index}: {', '.join(parts)}; {self.params:,} parameters, {self.flops_per_token:,} forward FLOPs/token"


# The pipeline's parts of a model (its layer list, what only the first / last stage keeps), as
# the model's anatomy names them (smp/anatomy.py).
ModelParts = PipelineParts


def _get(model: nn.Module, path: str) -> Any:
    for part in path.split("."):
        model = getattr(model, part)
    return model


def _set(model: nn.Module, path: str, value: nn.Module | None) -> None:
    *parents, name = path.split(".")
    owner = model
    for part in parents:
        owner = getattr(owner, part)
    own_children(owner)[name] = value  # None keeps the name registered but holds nothing


def find_parts(model: nn.Module, anatomy: Anatomy | None = None) -> ModelParts:
    """The layer list and the first- / last-stage modules of `model`, or ConfigError saying why
    smp cannot split it. `anatomy`: the picture already taken of `model` (smp/anatomy.py)."""
    return (anatomy or describe(model)).require_pipeline()


# ----------------------------------------------------------------------------------------------
# Proof that the forward is a chain through the layers


class _Recorder(nn.Module):
    """Stands in for a model part during `check_layer_chain`: records what it received and
    returns fresh random values, so where they go next can be followed."""

    def __init__(self, name: str, log: list, shape: Callable[[torch.Tensor], tuple[int, ...]]):
        super().__init__()
        self.name, self.log, self.shape = name, log, shape

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0] if args else next(iter(kwargs.values()))
        out = torch.randn(self.shape(x), generator=torch.Generator().manual_seed(len(self.log) + 1))
        self.log.append((self.name, x, out))
        return out


def check_layer_chain(model: nn.Module, parts: ModelParts) -> None:
    """Raise ConfigError unless the model's forward is a plain chain: `inputs_embeds` (HF) go
    unchanged into layer 0, each layer's output into the next, the last layer's into the final
    norm and head. Runs the model's own forward once on a parameter-free copy whose parts are
    recorders (cheap; works for meta models too)."""
    log: list = []
    layers = _get(model, parts.layers)
    hidden = 8
    memo: dict[int, Any] = {}
    for i, layer in enumerate(layers):
        memo[id(layer)] = _Recorder(f"{parts.layers}.{i}", log, lambda x: tuple(x.shape))
    for name in parts.first:
        memo[id(_get(model, name))] = _Recorder(name, log, lambda x: (*x.shape[:2], hidden))
    for name in parts.last:
        memo[id(_get(model, name))] = _Recorder(name, log, lambda x: tuple(x.shape))
    for p in model.parameters():  # a checked model holds none outside its parts: never copied
        memo.setdefault(id(p), p)
    skeleton = copy.deepcopy(model, memo)
    if any(b.is_meta for b in skeleton.buffers()):
        skeleton.to_empty(device="cpu")  # rotary inv_freq etc.: values do not matter here
    embeds = torch.randn(1, 2, hidden, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            if parts.hf:
                type(model).forward(skeleton, inputs_embeds=embeds, use_cache=False)
            else:
                out = skeleton(torch.zeros(1, 2, dtype=torch.long))
    except Exception as e:  # e.g. the forward reads a layer's attributes (its block type)
        raise ConfigError(
            f"smp cannot split {type(model).__name__} into pipeline stages: its forward does more with its "
            f"layers than call them in a chain ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), "
            f"so smp cannot prove a stage boundary drops nothing; set pipeline_parallel_degree: 1 for this model"
        ) from e
    order = [name for name, _, _ in log]
    want = ([] if parts.hf else list(parts.first)) + [f"{parts.layers}.{i}" for i in range(len(layers))] + list(parts.last)
    problem = None
    if order != want:
        problem = f"its forward calls {order}, not {want} in that order"
    elif parts.hf and not torch.equal(log[0][1], embeds):
        problem = f"its forward changes inputs_embeds before {log[0][0]} (e.g. scales them or adds position embeddings)"
    else:
        for (before, _, sent), (name, received, _) in zip(log, log[1:]):
            if not (isinstance(received, torch.Tensor) and torch.equal(received, sent)):
                problem = f"{name} does not receive {before}'s output unchanged"
                break
        if problem is None and not parts.hf and not torch.equal(out, log[-1][2]):
            problem = f"its output is not {log[-1][0]}'s output"
    if problem:
        raise ConfigError(
            f"smp cannot split {type(model).__name__} into pipeline stages: {problem}. A stage boundary there "
            f"would drop what the forward adds; set pipeline_parallel_degree: 1 for this model"
        )


# ----------------------------------------------------------------------------------------------
# Balancing


def _cost(module: nn.Module | None) -> tuple[int, int]:
    """(parameters, forward FLOPs per token) of a module: embeddings are lookups (no FLOPs)."""
    if module is None:
        return 0, 0
    params = sum(p.numel() for p in module.parameters())
    lookups = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Embedding))
    norms = sum(p.numel() for m in module.modules() if is_norm(m) for p in m.parameters(recurse=False))
    return params, 2 * (params - lookups - norms)


def plan_split(model: nn.Module, num_stages: int, split: str | Sequence[int] = "auto",
               parts: ModelParts | None = None) -> list[StageInfo]:
    """The layers of each of `num_stages` stages: `split` = "auto" balances forward FLOPs (then
    parameters) with the embedding on stage 0 and the norm and head on the last; a list gives
    the first layer of every stage after the first. `parts`: `find_parts(model)` already taken."""
    parts = parts or find_parts(model)
    layers = _get(model, parts.layers)
    n = len(layers)
    if n < num_stages:
        raise ConfigError(
            f"{type(model).__name__} has {n} layers, fewer than the {num_stages} pipeline stages "
            f"(pipeline_parallel_degree x pipeline.stages_per_rank): every stage needs at least one layer"
        )
    layer_costs = [_cost(layer) for layer in layers]
    first_cost = [sum(c) for c in zip(*([_cost(_get(model, p)) for p in parts.first] or [(0, 0)]))]
    last_cost = [sum(c) for c in zip(*([_cost(_get(model, p)) for p in parts.last] or [(0, 0)]))]
    if split == "auto":
        bounds = _balanced_bounds([f for _, f in layer_costs], [p for p, _ in layer_costs], num_stages,
                                  first_cost, last_cost)
    else:
        bounds = [0, *split, n]
        if bounds[-2] >= n:
            raise ConfigError(f"pipeline.split={list(split)} names layer {bounds[-2]}, but {type(model).__name__} has layers 0-{n - 1}")
    stages = []
    for s in range(num_stages):
        rng = range(bounds[s], bounds[s + 1])
        params = sum(layer_costs[i][0] for i in rng)
        flops = sum(layer_costs[i][1] for i in rng)
        if s == 0:
            params, flops = params + first_cost[0], flops + first_cost[1]
        if s == num_stages - 1:
            params, flops = params + last_cost[0], flops + last_cost[1]
        stages.append(StageInfo(s, rng, params, flops, s == 0, s == num_stages - 1))
    return stages


def _balanced_bounds(flops: list[int], params: list[int], k: int, first: list[int], last: list[int]) -> list[int]:
    """Contiguous layer ranges for k stages minimising the largest stage's (FLOPs, parameters)."""
    n = len(flops)
    pre_f = [0]
    pre_p = [0]
    for f, p in zip(flops, params):
        pre_f.append(pre_f[-1] + f)
        pre_p.append(pre_p[-1] + p)

    def cost(s: int, a: int, b: int) -> tuple[int, int]:
        f, p = pre_f[b] - pre_f[a], pre_p[b] - pre_p[a]
        if s == 0:
            f, p = f + first[1], p + first[0]
        if s == k - 1:
            f, p = f + last[1], p + last[0]
        return f, p

    inf = (float("inf"), float("inf"))
    # best[s][b]: the smallest max-cost of stages 0..s holding layers [0, b); cut[s][b]: where s starts
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, 0, b)
    for s in range(1, k):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                c = max(best[s - 1][a], cost(s, a, b))
                if c < best[s][b]:
                    best[s][b], cut[s][b] = c, a
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return [0, *reversed(bounds)]


# ----------------------------------------------------------------------------------------------
# Stage modules


class _PassThrough(nn.Module):
    """A decoder layer another stage holds: returns its hidden state unchanged (no parameters)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]


def stage_indices(pp_rank: int, pp: int, local_stages: int, v_shape: bool) -> list[int]:
    """The stages rank `pp_rank` holds: r, r+p, r+2p, ... (loop), or r and 2p-1-r (V)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(local_stages)]


def build_stage_module(model: nn.Module, parts: ModelParts, stage: StageInfo) -> nn.Module:
    """A module for `stage`: a copy of `model`'s skeleton sharing (not copying) the parts the
    stage owns, with the rest removed, and a forward that runs just this stage."""
    layers = _get(model, parts.layers)
    memo: dict[int, Any] = {}
    for i, layer in enumerate(layers):
        memo[id(layer)] = layer if i in stage.layers else (_PassThrough() if parts.hf else None)
    for name in parts.first:
        module = _get(model, name)
        memo[id(module)] = module if stage.first else None
    for name in parts.last:
        module = _get(model, name)
        memo[id(module)] = module if stage.last else (nn.Identity() if parts.hf and name.startswith(parts.layers.split(".")[0] + ".") else None)
    for p in model.parameters():  # parameters outside the parts (none for a checked model): shared
        memo.setdefault(id(p), p)
    config = getattr(model, "config", None)
    if config is not None:
        # One config for the stage and the layers it shares with the model: what the recipe sets
        # on the stage's config (context parallel's attention implementation) is what they read.
        memo[id(config)] = config
    stage_module = copy.deepcopy(model, memo)
    if not parts.hf:
        listed = _get(stage_module, parts.layers)
        children = own_children(listed)
        for key in [k for k, v in children.items() if v is None]:
            del children[key]  # keys of the kept layers keep their original index
    stage_module.forward = types.MethodType(_hf_stage_forward if parts.hf else _plain_stage_forward, stage_module)
    stage_module._smp_stage = (stage, parts)  # read by the stage forward
    return stage_module


def _hf_stage_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One stage of a transformers causal LM: token ids in on the first stage, hidden states in
    on the others; logits out of the last, hidden states out of the others. `position_ids` and
    `attention_mask` (packed rows: the documents' positions, from which transformers builds the
    per-document mask; context parallel: the positions and key padding of this rank's chunks of
    each row) are given to every stage alike; None lets the model count positions over its input."""
    stage, parts = self._smp_stage
    inputs = {"input_ids": x} if stage.first else {"inputs_embeds": x}
    for key, value in (("position_ids", position_ids), ("attention_mask", attention_mask)):
        if value is not None:
            inputs[key] = value
    if stage.last:
        return type(self).forward(self, **inputs, use_cache=False).logits
    base = _get(self, parts.layers.rsplit(".", 1)[0])
    return base(**inputs, use_cache=False).last_hidden_state


def _plain_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    stage, parts = self._smp_stage
    if stage.first:
        for name in parts.first:
            x = _get(self, name)(x)
    for layer in _get(self, parts.layers):
        x = layer(x)
    if stage.last:
        for name in parts.last:
            x = _get(self, name)(x)
    return x


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (the blocks the split distributes) of a model smp can split."""
    return list(_get(model, find_parts(model).layers))


# ----------------------------------------------------------------------------------------------
# One module with the names of the whole model, for checkpoints and export


class StagesView(nn.Module):
    """This rank's stages as one module tree with the whole model's names: each submodule is
    the stage module holding tensors under that name (containers that several stages share,
    the base model and its layer list, are merged). Its `named_parameters` / `state_dict` are
    the rank's slice of the model's, under the model's names, so torch.distributed.checkpoint's
    state-dict functions (which walk the module tree to name parameters and optimizer state)
    see the names a model without pp has. It holds no tensor of its own and is never called."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a StagesView names this rank's pipeline stages for checkpoints; it does not run")


def whole_model_view(stages: Sequence[nn.Module]) -> nn.Module:
    """A module whose parameter and buffer names are the whole model's, holding the tensors
    of `stages` (this rank's stage modules): the stage itself when there is one."""
    if len(stages) == 1:
        return stages[0]
    view = _merge(list(stages))
    first = stages[0]
    for attr in ("config", "generation_config", "base_model_prefix", "all_tied_weights_keys", "_smp_tied_names"):
        if hasattr(first, attr):
            setattr(view, attr, getattr(first, attr))  # what export_hf reads of the model
    return view


def _holds_state(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in (*module.parameters(), *module.buffers()))


def _merge(modules: list[nn.Module | None]) -> nn.Module | None:
    holders = list({id(m): m for m in modules if _holds_state(m)}.values())
    if len(holders) <= 1:
        return holders[0] if holders else next((m for m in modules if m is not None), None)
    if any(_own_state(m) for m in holders):
        if any(True for m in holders for _ in m.parameters()):
            raise ConfigError(
                f"pipeline stages hold different {type(holders[0]).__name__} modules with parameters under "
                "one name; smp cannot give them the whole model's names"
            )
        return holders[0]  # a buffer-only module every stage keeps a copy of (rotary embedding)
    view = StagesView()
    children: dict[str, list[nn.Module | None]] = {}
    for m in holders:
        for name, child in own_children(m).items():
            children.setdefault(name, []).append(child)
    for name, group in children.items():
        own_children(view)[name] = _merge(group)
    return view


def _own_state(module: nn.Module) -> bool:
    return any(True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
