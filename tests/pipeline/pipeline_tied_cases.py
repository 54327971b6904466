"""Tied embeddings across pipeline stages, on every rank of a RankPool; each case returns plain
data."""

from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn

import smp
import smp.pipeline
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import random_batch, tiny_llama
from tests.pipeline.pipeline_cases import GLOBAL_BATCH, SEQ, VOCAB, reference_loss

TIED = ("model.embed_tokens.weight", "lm_head.weight")


def tied_model(kind: str, layers: int = 4) -> nn.Module:
    """A tiny causal LM whose LM head is its input embedding (tie_word_embeddings)."""
    if kind == "tied_llama":
        return tiny_llama(num_hidden_layers=layers, tie_word_embeddings=True)
    if kind == "gemma":
        from transformers import GemmaConfig, GemmaForCausalLM

        return GemmaForCausalLM(GemmaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
            tie_word_embeddings=True,
        ))
    raise ValueError(kind)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def equivalence(config: dict, kind: str = "tied_llama", steps: int = 3, skip_sum: bool = False,
                clip: float | None = None) -> dict:
    """The pipelined run vs one process over `steps` AdamW steps on the same init and batch:
    the largest loss and gradient differences (every name of the model, both names of the tied
    tensor included) and, after the steps, a digest of each tied copy this rank holds.
    skip_sum: the negative control (the step does not sum the copies' gradients)."""
    from smp.pipeline import schedule

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = tied_model(kind)
        model = smp.transform(copy.deepcopy(reference))
        saved = schedule.sum_tied_grads
        if skip_sum:
            schedule.sum_tied_grads = lambda *args, **kwargs: None
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
            ref_params = dict(reference.named_parameters(remove_duplicate=False))
            report = {"loss_diff": 0.0, "grad_diff": 0.0, "norm_diff": 0.0, "tied_names": [],
                      "per_step": [0.0] * steps}
            for step in range(steps):
                batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100 + step)
                loss = smp.pipeline.step(model, local_rows(batch))
                ref_loss = reference_loss(reference, batch)
                ref_loss.backward()
                if clip is not None:
                    norm = smp.clip_grad_norm_(model, clip)
                    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
                    report["norm_diff"] = max(report["norm_diff"], abs(float(norm) - float(ref_norm)))
                report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss.detach())))
                for stage in model.stages:
                    for name, p in stage.named_parameters(remove_duplicate=False):
                        diff = float((full_tensor(p.grad) - ref_params[name].grad).abs().max())
                        report["grad_diff"] = max(report["grad_diff"], diff)
                        report["per_step"][step] = max(report["per_step"][step], diff)
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
        finally:
            schedule.sum_tied_grads = saved
        digests = {}
        for stage in model.stages:
            for name, p in stage.named_parameters(remove_duplicate=False):
                if name in TIED:
                    digests[name] = _digest(full_tensor(p))
                    report["tied_names"].append(name)
        report["digests"] = digests
        report["reference_digest"] = _digest(ref_params[TIED[0]])
        return report


def _diff(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    """Largest |value - want| over this rank's parameters, every name of each (both of a tie)."""
    return max(float((full_tensor(p.detach()) - want[name].detach()).abs().max())
               for stage in model.stages for name, p in stage.named_parameters(remove_duplicate=False))


def lifecycle(config: dict, path: str, export: str, kind: str = "tied_llama") -> dict:
    """A tied model through delayed init, a checkpoint and an HF export at pp 2: per-stage init
    of a meta model vs eager construction, export_hf read back by from_pretrained, transform(meta,
    weights=export), and a checkpoint loaded into a differently initialised pipelined model (the
    largest differences; 0.0: bitwise), and a digest of each tied copy at each point."""
    from transformers import AutoModelForCausalLM

    report: dict = {"digests": {}}

    def digests(tag: str, model: nn.Module) -> None:
        for stage in model.stages:
            for name, p in stage.named_parameters(remove_duplicate=False):
                if name in TIED:
                    report["digests"].setdefault(tag, []).append(_digest(full_tensor(p)))

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        eager = dict(tied_model(kind).named_parameters(remove_duplicate=False))
        torch.manual_seed(smp.state.config.random_seed)
        with torch.device("meta"):
            meta = tied_model(kind)
        model = smp.transform(meta)
        report["meta_diff"] = _diff(model, eager)
        digests("meta", model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        smp.pipeline.step(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=7)))
        opt.step()
        opt.zero_grad()
        digests("step", model)
        trained = {name: full_tensor(p.detach()).clone() for stage in model.stages
                   for name, p in stage.named_parameters(remove_duplicate=False)}
        smp.checkpointing.save(path, model, opt)
        smp.checkpointing.export_hf(export, model)
        pretrained = AutoModelForCausalLM.from_pretrained(export)
        want = dict(pretrained.named_parameters(remove_duplicate=False))
        report["export_diff"] = _diff(model, want)
        report["export_tied"] = pretrained.lm_head.weight is pretrained.model.embed_tokens.weight
        with torch.device("meta"):
            meta = tied_model(kind)
        loaded = smp.transform(meta, weights=export)
        report["weights_diff"] = _diff(loaded, want)
        digests("weights", loaded)
        torch.manual_seed(123)  # another init: the checkpoint must overwrite all of it
        fresh = smp.transform(tied_model(kind))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        smp.checkpointing.load(path, fresh, fresh_opt)
        report["load_diff"] = _diff(fresh, trained)
        digests("load", fresh)
    return report


def layout_refusal(config: dict) -> str:
    """Two pipeline ranks holding copies of one tied tensor in different layouts (here: local
    shapes, as a TP style on one copy only would give): the message plan_ties raises ('' if
    none), on every rank."""
    import torch.distributed as dist

    from smp.pipeline.tied import plan_ties

    with smp.session(config):
        rank = dist.get_rank()
        stage = nn.Module()
        stage.register_parameter("embed" if rank == 0 else "head", nn.Parameter(torch.zeros(8, 4 if rank == 0 else 2)))
        try:
            plan_ties([("embed", "head")], [stage], dist.group.WORLD)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""
