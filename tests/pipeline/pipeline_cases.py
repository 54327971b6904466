"""Pipeline-parallel cases that run on every rank of a RankPool; each returns plain data."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import smp
import smp.pipeline
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import TinyTransformer, random_batch, tiny_llama

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 256


def tiny_model(kind: str, layers: int = 4) -> nn.Module:
    """The families the pipeline tests run: small enough for CPU, 4 layers by default."""
    if kind == "llama":
        return tiny_llama(num_hidden_layers=layers)
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
            tie_word_embeddings=False,
        ))
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(
            hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, num_local_experts=4,
            num_experts_per_tok=2,
        ))
    if kind == "tied_llama":
        return tiny_llama(num_hidden_layers=layers, tie_word_embeddings=True)
    if kind == "plain":
        return TinyTransformer(vocab=VOCAB, layers=layers)
    if kind == "skip":
        return SkipTransformer(vocab=VOCAB, layers=layers)
    raise ValueError(kind)


class SkipTransformer(TinyTransformer):
    """A long residual: the embedding is added again before the head. A stage boundary that
    sends only the last layer's output drops it (the negative control for the chain check)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x0 = x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x + x0))


def reference_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids) if not isinstance(model, TinyTransformer) else model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def equivalence(config: dict, kind: str = "llama", steps: int = 2, loss: str = "default",
                skip_chain_check: bool = False, clip: float | None = None) -> dict:
    """The pipelined run vs one process on the same init and global batch, over `steps` SGD
    steps: the largest loss and gradient differences, and the split this rank saw.

    loss: "default" (smp's token mean), "mean" (a per-micro-batch mean loss_fn), "unscaled" (the
    negative control: a per-micro-batch mean not divided by the micro-batch count). `clip`:
    smp.clip_grad_norm_ vs torch's on the reference before the gradients are compared."""
    with smp.session(config):
        smp.gradient_sync_bytes(reset=True)  # _what_acted reads this run's bytes only
        torch.manual_seed(smp.state.config.random_seed)
        reference = tiny_model(kind)
        model = copy.deepcopy(reference)
        if skip_chain_check:  # the negative control: split a model the check would refuse
            from smp.pipeline import schedule

            saved, schedule.check_layer_chain = schedule.check_layer_chain, lambda model, parts: None
            try:
                model = smp.transform(model)
            finally:
                schedule.check_layer_chain = saved
        else:
            model = smp.transform(model)
        microbatches = model.pipe.microbatches or smp.state.mesh["pp"].size() * len(model.stages)
        loss_fn = {
            "default": None,
            "mean": mean_ce,
            "unscaled": lambda logits, labels: mean_ce(logits, labels) * microbatches,
        }[loss]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_params = dict(reference.named_parameters())
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "names": [], "split": model.describe_split()}
        for step in range(steps):
            batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)  # same batch: the loss must fall
            loss_value = smp.pipeline.step(model, local_rows(batch), loss_fn=loss_fn)
            ref_loss = reference_loss(reference, batch)
            ref_loss.backward()
            if clip is not None:
                norm = smp.clip_grad_norm_(model, clip)
                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
                report["norm_diff"] = max(report.get("norm_diff", 0.0), abs(float(norm) - float(ref_norm)))
            report["losses"].append(float(ref_loss.detach()))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss_value) - float(ref_loss)))
            for name, p in model.named_parameters():
                diff = float((full_tensor(p.grad) - ref_params[name].grad).abs().max())
                report["grad_diff"] = max(report["grad_diff"], diff)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        report["names"] = sorted(n for n, _ in model.named_parameters())
        report["acted"] = _what_acted(model)
        return report


def _what_acted(model) -> dict:
    """What the recipe did inside this rank's stages (a mode that did nothing proves nothing):
    activation bytes moved to host in the last forward, blocks compiled, gradient-sync bytes of
    smp's own collectives in this run (ring / int8 / fp8; the default path is not counted)."""
    from smp.activations import offload_stats
    from smp.sharding.gradient_sync import gradient_sync_bytes

    stats = [offload_stats(stage) for stage in model.stages]
    return {
        "offloaded_bytes": sum(s.total_offloaded_bytes for s in stats if s is not None),
        "compiled_blocks": sum(1 for stage in model.stages for m in stage.modules() if getattr(m, "_compiled_call_impl", None)),
        "sync_bytes": {k: v for k, v in gradient_sync_bytes().items() if v and k != "total"},
    }


def error_of_transform(config: dict, kind: str) -> str:
    """The message of the smp.Error that smp.transform raises on this rank ('' if none)."""
    with smp.session(config):
        try:
            smp.transform(tiny_model(kind))
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
    return ""



def all_gathers_per_step(config: dict, steps: int = 2) -> dict:
    """FSDP all-gathers one pipelined training step issues on this rank, and its FSDP units.
    Counted at torch.distributed.all_gather_single, which FSDP2's default all-gather calls."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_model("llama"))
        units = sum(isinstance(m, FSDPModule) for stage in model.stages for m in stage.modules())
        batch = local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100))
        smp.pipeline.step(model, batch)  # the first step also runs torch's shape inference
        calls = []
        original = dist.all_gather_single

        def counting(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        dist.all_gather_single = counting
        try:
            for _ in range(steps):
                smp.pipeline.step(model, batch)
        finally:
            dist.all_gather_single = original
        sharded = all(isinstance(p, torch.distributed.tensor.DTensor) and p._local_tensor.numel() < p.numel()
                      for p in model.parameters())
        return {"units": units, "per_step": len(calls) / steps, "resharded_after_step": sharded}


def call_errors(config: dict, path: str) -> list[str]:
    """What a pipelined model answers when used wrong: called like the whole model without labels,
    a batch the micro-batches do not divide (padded: no error), a state_dict loaded into it
    (checkpoints go through smp.checkpointing)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_model("llama"))
        errors = []
        for attempt in (lambda: model(torch.zeros(2, 4, dtype=torch.long)),
                        lambda: smp.pipeline.step(model, torch.zeros(3, 4, dtype=torch.long)),
                        lambda: model.load_state_dict(model.state_dict())):
            try:
                attempt()
                errors.append("")
            except (smp.Error, AttributeError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        return errors



def meta_equals_eager(config: dict) -> float:
    """A model built on the meta device and pipelined vs the eager model: the largest parameter
    difference (0.0: bitwise)."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        eager = tiny_model("llama")
        with torch.device("meta"):
            model = tiny_model("llama")
        model = smp.transform(model)
        ref = dict(eager.named_parameters())
        return max(float((full_tensor(p.detach()) - ref[n].detach()).abs().max()) for n, p in model.named_parameters())
