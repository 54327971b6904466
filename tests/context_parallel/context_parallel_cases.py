"""Context-parallel cases that run on every rank of a RankPool; each returns plain data.

The reference (one process, the whole global batch, the model's own attention) runs first, on a
copy of the same init, before smp.transform activates context parallel attention in the process;
then the cp run replays the same steps and is compared step by step (loss and every gradient).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import smp
import smp.context_parallel as cp
from smp.context_parallel import allgather, ring, sharding, ulysses
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import random_batch, tiny_llama

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 128
PAD = 5  # right padding of rows 0 and 2 (one row per data-parallel group at dp = 2: equal counts)


class UserBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        a = self.attend(q, k, v, padding)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        return cp.attention(q, k, v, causal=True, key_padding_mask=padding)


class InlineSDPABlock(UserBlock):
    """A layer that computes its attention inline with F.scaled_dot_product_attention."""

    def attend(self, q, k, v, padding):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class HandWrittenAttentionBlock(UserBlock):
    """A layer that computes softmax(q @ k^T) v by hand."""

    def attend(self, q, k, v, padding):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


class UserModel(nn.Module):
    """A user's model: learned absolute positions (read from position_ids), attention through
    smp.context_parallel.attention, blocks in an nn.ModuleList."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, hidden: int = 64, layers: int = 2, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(UserBlock(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.positions(position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.head(self.norm(x))


def build(kind: str) -> nn.Module:
    """Tiny models, dropout 0. Every HF kind but llama_mha is GQA (4 heads / 2 key-value heads)."""
    if kind == "llama":
        return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64)
    if kind == "llama_mha":  # 4 key-value heads: Ulysses splits them over cp 2 x tp 2
        return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_key_value_heads=4)
    if kind == "qwen2":  # sliding window 5 on every layer: windows cross the chunk boundaries
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            use_sliding_window=True, sliding_window=5, max_window_layers=0,
        ))
    if kind == "mistral":  # sliding window 6
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=6,
        ))
    if kind == "mixtral":  # MoE: experts through grouped_mm, which the attention probe stands in for on meta
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, num_local_experts=4,
            num_experts_per_tok=2,
        ))
    if kind == "user":
        return UserModel()
    raise ValueError(kind)


def global_batch(padding: bool) -> dict[str, torch.Tensor]:
    ids = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
    if not padding:
        return {"input_ids": ids}
    mask = torch.ones_like(ids)
    mask[0, -PAD:] = 0
    mask[2, -PAD:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss on a `shard_batch` result (user model) or the model's own loss."""
    if isinstance(model, UserModel):
        logits = model(batch["input_ids"], batch["position_ids"], batch.get("attention_mask"))
        return cp.token_loss(logits, batch)
    return model(**batch).loss


def reference_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One process, whole sequences. HF models shift their labels themselves (an independent
    check of smp's global shift); the user model uses the same loss on the unsharded batch."""
    if isinstance(model, UserModel):
        return loss_of(model, sharding.shard_batch(batch, cp_size=1, cp_rank=0, load_balance=False))
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


@contextlib.contextmanager
def _corrupted(kind: str | None) -> Iterator[None]:
    """Mutations the comparison must catch: `drop_lse` merges partial outputs without their
    log-sum-exp weights; `skip_step` drops every key/value block but the rank's own;
    `wrong_head_order`: Ulysses puts the head groups back in reverse rank order."""
    if kind is None:
        yield
        return
    saved = ring.merge, allgather.merge, ring.block_forward, allgather.block_forward, ulysses.heads_home
    if kind == "drop_lse":
        def bad_merge(out, lse, part_out, part_lse):
            return out + part_out, torch.logaddexp(lse, part_lse)
        ring.merge = allgather.merge = bad_merge
    elif kind == "skip_step":
        real = ring.block_forward

        def bad_block(q, k, v, keep, q_segments, k_segments, **kw):
            out, lse = real(q, k, v, keep, q_segments, k_segments, **kw)
            if q_segments != k_segments:
                return torch.zeros_like(out), torch.full_like(lse, float("-inf"))
            return out, lse
        ring.block_forward = allgather.block_forward = bad_block
    elif kind == "wrong_head_order":
        home = ulysses.heads_home

        def reversed_home(parts, group, size):
            return torch.cat(home(parts, group, size).chunk(size, dim=1)[::-1], dim=1)
        ulysses.heads_home = reversed_home
    else:
        raise ValueError(kind)
    try:
        yield
    finally:
        ring.merge, allgather.merge, ring.block_forward, allgather.block_forward, ulysses.heads_home = saved


def equivalence(config: dict, kind: str, steps: int = 2, padding: bool = False,
                corrupt: str | None = None) -> dict:
    """cp (x FSDP / TP / checkpointing) run vs the single-process run: same init, same global
    batch, SGD steps; max |loss gap| and max |gradient gap| over the steps."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build(kind)
        model = copy.deepcopy(reference)
        batch = global_batch(padding)

        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_losses, ref_grads = [], []
        for _ in range(steps):
            loss = reference_loss(reference, batch)
            loss.backward()
            ref_losses.append(float(loss.detach()))
            ref_grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
            ref_opt.step()
            ref_opt.zero_grad()

        model = smp.transform(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = {name: local_rows(t) for name, t in batch.items()}
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": ref_losses, "cp_rank": smp.state.cp_rank,
                  "cp_size": smp.state.cp_size, "dp_rank": smp.state.dp_rank,
                  "attn": getattr(model.config, "_attn_implementation", None) if hasattr(model, "config") else None}
        with _corrupted(corrupt), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                loss = loss_of(model, cp.shard_batch(rows))
                loss.backward()
                report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - ref_losses[step]))
                gap = max(float((full_tensor(p.grad) - ref_grads[step][n]).abs().max())
                          for n, p in model.named_parameters())
                report["grad_diff"] = max(report["grad_diff"], gap)
                opt.step()
                opt.zero_grad()
        # The attention probe ran (it warns when it cannot) and passed the model.
        report["probe_warnings"] = [str(w.message) for w in caught if "could not check" in str(w.message)]
        return report


def shard_error(config: dict, seq_len: int) -> str:
    """The error shard_batch raises for a sequence length ('' if none)."""
    with smp.session(config):
        smp.transform(build("llama"))
        try:
            cp.shard_batch(random_batch(2, seq_len, VOCAB, seed=0))
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""


def transform_error(config: dict, kind: str) -> str:
    """The error smp.transform (or the first forward) raises for a model ('' if none)."""
    with smp.session(config):
        try:
            model = smp.transform(_bad_model(kind))
            model(random_batch(2, SEQ // 2, VOCAB, seed=0))
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""


class _CollectiveCount(TorchDispatchMode):
    """Counts the collectives (c10d operators) that run under it: FSDP's all-gathers, the
    context parallel attention's exchanges."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func._schema.name.split("::")[0] in ("c10d", "_c10d_functional"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _probe_installed(installed: bool) -> Iterator[None]:
    """`installed=False`: smp.transform leaves the attention probe out (the negative control of
    "before any collective": the runtime check alone raises after FSDP's all-gathers)."""
    transform_module = importlib.import_module("smp.transform")
    saved = transform_module.install_attention_probe
    if not installed:
        transform_module.install_attention_probe = lambda model, probe: None
    try:
        yield
    finally:
        transform_module.install_attention_probe = saved


def first_forward_error(config: dict, kind: str, probe: bool = True) -> dict:
    """Transform a model, run its first forward (and backward) on this rank's chunks, counting
    collectives: the error smp raised ('' if none), how many collectives had run when it was
    raised, and smp's warnings."""
    with smp.session(config):
        torch.manual_seed(0)
        with _probe_installed(probe):
            model = smp.transform(_bad_model(kind))
        batch = cp.shard_batch({name: local_rows(t) for name, t in global_batch(padding=False).items()})
        counter = _CollectiveCount()
        error = ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with counter:
                    if isinstance(model, UserModel):
                        loss = loss_of(model, batch)
                    else:
                        loss = model(batch["input_ids"]).float().mean()
                    loss.backward()
            except smp.Error as e:
                error = f"{type(e).__name__}: {e}"
        return {"error": error, "collectives": counter.count,
                "warnings": [str(w.message) for w in caught if "context parallel" in str(w.message)]}


class _MHAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.attn(x, x, x, need_weights=False)[0]


class _LocalAttentionModel(nn.Module):
    """Attention computed inline with F.scaled_dot_product_attention: smp cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)


class _NoAttentionModel(nn.Module):
    """Token-wise layers only: nothing attends, smp's attention is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class _ValueReadingModel(UserModel):
    """Reads a tensor value in forward (which the meta-device probe cannot); `inline`: every
    layer computes attention with F.scaled_dot_product_attention."""

    def __init__(self, inline: bool, mixed: bool = False) -> None:
        super().__init__()
        if inline:
            self.layers = nn.ModuleList(InlineSDPABlock(32, 64) for _ in self.layers)
        if mixed:  # only the last layer computes attention inline
            self.layers[-1] = InlineSDPABlock(32, 64)

    def forward(self, input_ids, position_ids, attention_mask=None):
        if int(input_ids.max()) >= VOCAB:
            raise ValueError("token id out of range")
        return super().forward(input_ids, position_ids, attention_mask)


def _with_layer(block: type[UserBlock]) -> UserModel:
    """The user model with its second (last) layer replaced by `block`."""
    model = UserModel()
    model.layers[1] = block(32, 64)
    return model


def _bad_model(kind: str) -> nn.Module:
    if kind == "mha":
        return _MHAModel()
    if kind == "inline_sdpa":
        return _LocalAttentionModel()
    if kind == "no_attention":
        return _NoAttentionModel()
    if kind == "mixed_sdpa":
        return _with_layer(InlineSDPABlock)
    if kind == "hand_softmax":
        return _with_layer(HandWrittenAttentionBlock)
    if kind in ("reads_values", "reads_values_inline", "reads_values_mixed"):
        return _ValueReadingModel(inline=kind == "reads_values_inline", mixed=kind == "reads_values_mixed")
    if kind == "gemma2_softcap":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        return Gemma2ForCausalLM(Gemma2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, attn_logit_softcapping=50.0,
        ))
    if kind == "llama":  # fine for ring / allgather; Ulysses refuses its 2 key/value heads at cp 4 or cp 2 x tp 2
        return build("llama")
    if kind == "attention_dropout":
        return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, attention_dropout=0.1)
    raise ValueError(kind)


def _step_loss(model: nn.Module) -> torch.Tensor:
    """The loss on this rank's part of the padded global batch (rows by dp rank, then chunks)."""
    rows = {name: local_rows(t) for name, t in global_batch(padding=True).items()}
    return loss_of(model, cp.shard_batch(rows))


def checkpoint_round_trip(path: str, save_cp: int, load_cp: int) -> dict:
    """Train one step at context_parallel_degree `save_cp` and save; resume at `load_cp` from a
    different init: the parameters must come back bit for bit and the next loss must agree."""
    with smp.session({"context_parallel_degree": save_cp}):
        torch.manual_seed(0)
        model = smp.transform(build("llama"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step_loss(model).backward()
        opt.step()
        opt.zero_grad()
        smp.checkpointing.save(path, model, opt)
        saved = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        next_loss = world_mean(_step_loss(model))
    with smp.session({"context_parallel_degree": load_cp}):
        torch.manual_seed(1)
        model = smp.transform(build("llama"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        smp.checkpointing.load(path, model, opt)
        param_diff = max(float((full_tensor(p.detach()) - saved[n]).abs().max()) for n, p in model.named_parameters())
        loss_diff = abs(world_mean(_step_loss(model)) - next_loss)
        return {"param_diff": param_diff, "loss_diff": loss_diff}


def ulysses_bytes(seq: int = 32) -> dict:
    """Bytes this rank sends in one Ulysses forward + backward of the llama_mha model (counted at
    its all-to-alls, each mirrored by autograd in backward, and its all-gather) vs
    smp.context_parallel.cost.bytes_per_step, which `smp plan` reports."""
    from smp.context_parallel import cost

    with smp.session({"context_parallel_degree": 2, "context_parallel": {"algorithm": "ulysses"}}):
        torch.manual_seed(0)
        model = smp.transform(build("llama_mha"))
        sent = [0]
        real_a2a, real_gather = ulysses.all_to_all_autograd, ulysses.dist.all_gather_into_tensor

        def all_to_all(t, out_splits, in_splits, group):
            sent[0] += 2 * t.numel() * t.element_size() * (len(in_splits) - 1) // len(in_splits)
            return real_a2a(t, out_splits, in_splits, group)

        def gather(out, inp, group=None, **kw):
            sent[0] += (smp.state.cp_size - 1) * inp.numel() * inp.element_size()
            return real_gather(out, inp, group=group, **kw)

        ulysses.all_to_all_autograd, ulysses.dist.all_gather_into_tensor = all_to_all, gather
        try:
            model(**cp.shard_batch(random_batch(1, seq, VOCAB, seed=3))).loss.backward()
        finally:
            ulysses.all_to_all_autograd, ulysses.dist.all_gather_into_tensor = real_a2a, real_gather
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        formula = cost.bytes_per_step("ulysses", 2, 1, seq, config.num_key_value_heads * head_dim,
                                      config.num_hidden_layers, q_dim=config.hidden_size)
        return {"measured": sent[0], "formula": formula,
                "ring": cost.bytes_per_step("ring", 2, 1, seq, config.num_key_value_heads * head_dim,
                                            config.num_hidden_layers)}
