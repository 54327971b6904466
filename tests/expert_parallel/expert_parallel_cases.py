"""Expert-parallel cases that run on every rank of a RankPool; each returns plain data."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import smp
import smp.expert_parallel.dispatch as dispatch_module
import smp.expert_parallel.load_balancing as load_balancing
from smp.expert_parallel import expert_load, global_load_balancing_loss, is_expert_parallel
from smp.metrics import ExpertLoadMeter
from smp.tensor_parallel import causal_lm_loss
from smp.testing.distributed import full_tensor, local_rows, local_tensor, max_grad_diff, world_mean
from smp.testing.models import random_batch

GLOBAL_BATCH, SEQ, VOCAB, HIDDEN, EXPERTS, TOP_K = 4, 8, 256, 64, 4, 2
AUX_COEF = 0.1  # large enough that the load-balancing loss moves the router gradients visibly

USER_PLAN = {"layers.*.moe.experts": "ep_dispatch_experts"}


class UserExperts(nn.Module):
    """A user experts module following smp's contract: [E, ...] parameters and
    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, ffn) / math.sqrt(hidden))
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn, hidden) / math.sqrt(ffn))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.w_in.shape[0]):  # this rank's experts only, under expert parallelism
            token, slot = torch.where(top_k_index == e)
            y = torch.relu(hidden[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class UserMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = UserExperts(num_experts, hidden, 2 * hidden)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return self.experts(flat, index, weights).view_as(x), logits


class UserBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = UserMoE(hidden, EXPERTS, TOP_K)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, logits = self.moe(self.norm(x))
        return x + y, logits


class UserMoEModel(nn.Module):
    """Embedding, 2 MoE blocks, head; returns (logits, router logits per layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(UserBlock(HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x, router_logits = self.embed(ids), []
        for layer in self.layers:
            x, logits = layer(x)
            router_logits.append(logits)
        return self.head(x), tuple(router_logits)


ID_PLAN = {"layers.*.experts": "ep_dispatch_experts"}


class IdRoutedBlock(nn.Module):
    """A residual MoE block whose router is a fixed rule on the token ids: token t goes to experts
    t % E and (t % E + 1 + layer) % E, weight 1/2 each; so tokens per expert are known by hand."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.experts = UserExperts(EXPERTS, HIDDEN, 2 * HIDDEN)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + self.experts(x.reshape(-1, HIDDEN), *id_routing(ids, self.layer)).view_as(x)


def id_routing(ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = ids.reshape(-1) % EXPERTS
    index = torch.stack([first, (first + 1 + layer) % EXPERTS], dim=1)
    return index, torch.full(index.shape, 0.5)


class IdRoutedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(IdRoutedBlock(i) for i in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, ids)
        return causal_lm_loss(self.head(x), ids)


def expected_tokens_per_expert(batch: torch.Tensor) -> list[list[int]]:
    """By hand from the rule in IdRoutedBlock, per layer."""
    return [torch.bincount(id_routing(batch, layer)[0].reshape(-1), minlength=EXPERTS).tolist() for layer in range(2)]


def expert_load_metrics(config: dict, micro_batches: int = 2) -> dict:
    """One training step of IdRoutedModel in `micro_batches` micro-batches, then the step record
    of ExpertLoadMeter (smp.metrics) summed over the data-parallel ranks, and the hand count."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(IdRoutedModel(), moe_config=smp.expert_parallel.MoEConfig(plan=ID_PLAN))
        meter = ExpertLoadMeter(model, plan=ID_PLAN)
        batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=7)
        for chunk in local_rows(batch).chunk(micro_batches):
            model(chunk).backward()
        record = meter.record(smp.state.dp_mesh.get_group())
        return {**record, "expected": expected_tokens_per_expert(batch),
                "after": meter.record(smp.state.dp_mesh.get_group())}


def build(kind: str, **overrides) -> nn.Module:
    """Tiny MoE models: hidden 64, 2 layers, 4 experts, top-2, vocab 256, router logits on
    (`overrides`: other values of the transformers families' config)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=TOP_K,
                  output_router_logits=True, router_aux_loss_coef=AUX_COEF) | overrides
    if kind in ("mixtral", "mixtral3"):  # mixtral3: 3 experts, which EP=2 cannot split
        from transformers import MixtralConfig, MixtralForCausalLM

        experts = 3 if kind == "mixtral3" else EXPERTS
        return MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=experts, **common))
    if kind == "qwen2_moe":  # plus a shared expert beside the routed ones (stays data-parallel)
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=EXPERTS, **common))
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=EXPERTS, head_dim=16, **common))
    if kind == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        return OlmoeForCausalLM(OlmoeConfig(intermediate_size=32, num_experts=EXPERTS, **common))
    if kind == "user":
        return UserMoEModel()
    if kind == "dense":
        from smp.testing.models import tiny_llama

        return tiny_llama(vocab_size=VOCAB)
    raise ValueError(kind)


def loss_of(model: nn.Module, ids: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss including the load-balancing term, the load-balancing term)."""
    if isinstance(model, UserMoEModel):
        logits, router_logits = model(ids)
        aux = global_load_balancing_loss(router_logits, EXPERTS, TOP_K, group=group)
        return causal_lm_loss(logits, ids) + AUX_COEF * aux, aux
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.aux_loss


def _corrupt(kind: str):
    """Mutations of the dispatch that the comparison must catch. `misroute`: expert results come
    back in reversed row order (each token gets another token's result, across ranks);
    `no_backward_a2a`: the return all-to-all passes no gradient back (forward unchanged)."""
    original = dispatch_module._exchange
    calls = {"n": 0}

    def exchange(t, output_splits, input_splits, group):
        calls["n"] += 1
        if calls["n"] % 2:  # the dispatch (odd calls) stays correct; the return is broken
            return original(t, output_splits, input_splits, group)
        if kind == "misroute":
            return original(t, output_splits, input_splits, group).flip(0)
        out = original(t.detach(), output_splits, input_splits, group)
        return out + 0 * t.sum()  # no gradient reaches the experts of other ranks' tokens

    return exchange


def equivalence(config: dict, kind: str, steps: int = 3, corrupt: str | None = None,
                per_rank_aux: bool = False) -> dict:
    """EP (x FSDP) run vs the single-process run: same init, same global batch, SGD steps.
    `per_rank_aux` (negative control): the model's own load-balancing loss on this rank's rows
    only, i.e. without smp's reduction of the router statistics over the data-parallel ranks."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference), moe_config=_user_moe(kind))
        if corrupt:
            dispatch_module._exchange = _corrupt(corrupt)
        if per_rank_aux:  # smp's function, without the sum over ranks: transformers' value per rank
            load_balancing.global_load_balancing_loss = _per_rank_loss
        try:
            return _train_and_compare(model, reference, kind, steps)
        finally:
            dispatch_module._exchange = _ORIGINAL_EXCHANGE
            load_balancing.global_load_balancing_loss = _GLOBAL_LOSS


_GLOBAL_LOSS = load_balancing.global_load_balancing_loss


def _per_rank_loss(*args, group=None, **kwargs):
    return _GLOBAL_LOSS(*args, **kwargs)


_ORIGINAL_EXCHANGE = dispatch_module._exchange


def _user_moe(kind: str):
    return smp.expert_parallel.MoEConfig(plan=USER_PLAN) if kind == "user" else None


def _train_and_compare(model: nn.Module, reference: nn.Module, kind: str, steps: int) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    group = smp.state.dp_mesh.get_group()
    report = {"loss_diff": 0.0, "aux_diff": 0.0, "grad_diff": 0.0, "losses": [], "aux": []}
    batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
    for _ in range(steps):
        loss, aux = loss_of(model, local_rows(batch), group)
        loss.backward()
        ref_loss, ref_aux = loss_of(reference, batch)
        ref_loss.backward()
        report["losses"].append(float(ref_loss))
        report["aux"].append(float(ref_aux))
        report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
        report["aux_diff"] = max(report["aux_diff"], abs(world_mean(aux) - float(ref_aux)))
        report["grad_diff"] = max(report["grad_diff"], max_grad_diff(model, reference))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    report.update(_expert_accounting(model))
    return report


def _expert_accounting(model: nn.Module) -> dict:
    """Expert parameter elements: this rank's, the model's, and the ep axis's share."""
    experts = [m for m in model.modules() if is_expert_parallel(m)]
    params = [p for m in experts for p in m.parameters(recurse=False)]
    load = expert_load(model)
    return {
        "experts_modules": len(experts),
        "replicas": smp.state.dims.dp_replicate,
        "expert_local": sum(local_tensor(p).numel() for p in params),
        "expert_total": sum(p.numel() for p in params),
        "ep_placements": sorted({str(p.placements) for p in params if isinstance(p, DTensor)}),
        "tokens_per_expert": {name: s.tokens_per_expert for name, s in load.items()},
        "dropped": sum(s.dropped for s in load.values()),
    }


def capacity_drops(config: dict, capacity_factor: float) -> dict:
    """A forward with a capacity: dropped choices are counted, the loss stays finite."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build("mixtral"), moe_config=smp.expert_parallel.MoEConfig(capacity_factor=capacity_factor))
        loss, _ = loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3)))
        loss.backward()
        load = expert_load(model)
        return {"dropped": sum(s.dropped for s in load.values()), "finite": bool(torch.isfinite(loss)),
                "received": sum(sum(s.tokens_per_expert) for s in load.values())}


def transform_error(config: dict, kind: str, moe: dict | None = None) -> str:
    """The ConfigError smp.transform raises ('' if none)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = build(kind)
        try:
            smp.transform(model, moe_config=smp.expert_parallel.MoEConfig(**moe) if moe else None)
        except smp.ConfigError as e:
            return str(e)
        return ""


def full_expert_params(config: dict, kind: str) -> dict:
    """Each expert parameter gathered whole (a DTensor over ep x FSDP) vs the unsharded model."""
    with smp.session(config):
        torch.manual_seed(0)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference), moe_config=_user_moe(kind))
        ref = dict(reference.named_parameters())
        return {"max_diff": max(float((full_tensor(p.detach()) - ref[n]).abs().max()) for n, p in model.named_parameters())}


def save_checkpoint(config: dict, kind: str, path: str) -> None:
    """Train one AdamW step under `config`, save a sharded checkpoint to `path`, and (rank 0)
    the whole parameters beside it, for `load_checkpoint` to compare against."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build(kind), moe_config=_user_moe(kind))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=5)))[0].backward()
        opt.step()
        smp.checkpointing.save(path, model, opt, extra={"step": 1})
        smp.checkpointing.wait()
        whole = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        if smp.state.rank == 0:
            torch.save(whole, path + ".params.pt")


def load_checkpoint(config: dict, kind: str, path: str) -> dict:
    """Load `path` into a differently initialised model under `config` (another degree or
    world size): parameters equal the saved ones, and training goes on."""
    with smp.session(config):
        torch.manual_seed(1)
        model = smp.transform(build(kind), moe_config=_user_moe(kind))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = smp.checkpointing.load(path, model, opt)
        saved = torch.load(path + ".params.pt")
        diff = max(float((full_tensor(p.detach()) - saved[n]).abs().max()) for n, p in model.named_parameters())
        loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=6)))[0].backward()
        opt.step()
        return {"max_diff": diff, "step": extra["step"], "ep": smp.state.dims.ep}


def export_and_reload(config: dict, kind: str, out_dir: str) -> dict:
    """Export the EP-sharded model as a Hugging Face folder; transformers' from_pretrained
    loads it (rank 0) with the model's own expert layout and the same weights."""
    with smp.session(config):
        torch.manual_seed(0)
        reference = build(kind)
        model = smp.transform(copy.deepcopy(reference))
        smp.checkpointing.export_hf(out_dir, model)
        if smp.state.rank != 0:
            return {}
        loaded = type(reference).from_pretrained(out_dir)
        ref = dict(reference.named_parameters())
        return {"max_diff": max(float((p - ref[n]).abs().max()) for n, p in loaded.named_parameters()),
                "expert_shape": list(loaded.model.layers[0].mlp.experts.gate_up_proj.shape)}
