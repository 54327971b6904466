"""Pipeline-parallel delayed init, checkpoints and HF export/import, run on every rank of a
RankPool; each case returns plain data.

Data is fed by step index, so a resumed run sees the batches the uninterrupted one saw.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import smp
import smp.pipeline
from smp._compat import own_children
from smp.pipeline import build_stage_module, find_parts, plan_split
from smp.sharding import materialize_meta_model
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import TinyTransformer, loss_of, random_batch, tiny_llama

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 256


def model_of(kind: str) -> torch.nn.Module:
    if kind == "llama":
        return tiny_llama(num_hidden_layers=4)
    if kind == "plain":
        return TinyTransformer(vocab=VOCAB, layers=4)
    from tests.pipeline.pipeline_cases import tiny_model

    return tiny_model(kind)  # qwen3, mixtral


def _batch(step: int) -> torch.Tensor:
    return random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=2000 + step)


def _max_diff(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """Largest |value - reference| over this rank's parameters and buffers (whole tensors)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return max(float((full_tensor(t.detach()).float() - reference[n].detach().float()).abs().max()) for n, t in tensors)


def _pp_rank() -> int:
    return dist.get_rank(smp.state.mesh["pp"].get_group())


def _eager(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(smp.state.config.random_seed)
    eager = model_of(kind)
    return {**dict(eager.named_parameters()), **dict(eager.named_buffers())}


# ----------------------------------------------------------------------------------------------
# Per-stage delayed init


def stage_init(config: dict, kind: str) -> dict:
    """A meta model pipelined by smp.transform vs the eager model's slice on this rank: the
    largest difference (0.0: bitwise), whether any parameter was materialised beyond this
    rank's stages (no), and the negative control: each stage initialised on its own as if it
    were the whole model (the generator is not where eager construction had it)."""
    with smp.session(config):
        eager = _eager(kind)
        with torch.device("meta"):
            model = model_of(kind)
        pipelined = smp.transform(model)
        report = {"diff": _max_diff(pipelined, eager),
                  "others_on_meta": all(p.is_meta for n, p in model.named_parameters()
                                        if n not in dict(pipelined.named_parameters())),
                  "sharded": all(isinstance(p, DTensor) and p.to_local().numel() < p.numel()
                                 for p in pipelined.parameters())}
        with torch.device("meta"):
            naive = model_of(kind)
        parts = find_parts(naive)
        stage = build_stage_module(naive, parts, plan_split(naive, 2)[_pp_rank()])
        try:
            materialize_meta_model(stage, torch.device("cpu"), smp.state.config.random_seed)
            report["naive_diff"] = _max_diff(stage, eager)
        except smp.ConfigError as e:  # a transformers model: the draw proof refuses it
            report["naive_refused"] = str(e)
        return report


# ----------------------------------------------------------------------------------------------
# Save at pp 2, resume elsewhere


def _train(model, opt, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        batch = local_rows(_batch(step))
        if isinstance(model, smp.pipeline.PipelinedModel):
            loss = smp.pipeline.step(model, batch)
        else:
            loss = loss_of(model, batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(world_mean(loss))  # a pipeline's ranks repeat their data-parallel group's loss
    return losses


def _optim(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def save_at_pp(config: dict, path: str, export: str, meta_init: bool = False) -> dict:
    """Train 2 steps pipelined, save (model + AdamW state), export_hf, train 2 more: the
    uninterrupted losses of steps 2-3. Then the export loaded by from_pretrained (bitwise vs
    this rank's stages), and `smp.transform(meta model, weights=export)` at the same pp
    (bitwise vs from_pretrained)."""
    from transformers import AutoModelForCausalLM

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        if meta_init:
            with torch.device("meta"):
                model = model_of("llama")
        else:
            model = model_of("llama")
        model = smp.transform(model)
        opt = _optim(model)
        report = {"before": _train(model, opt, 0, 2)}
        smp.checkpointing.save(path, model, opt)
        smp.checkpointing.export_hf(export, model)
        exported = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        report["after"] = _train(model, opt, 2, 4)
        pretrained = AutoModelForCausalLM.from_pretrained(export)
        want = dict(pretrained.named_parameters())
        report["export_diff"] = max(float((exported[n] - want[n]).abs().max()) for n in exported)
        report["export_names"] = sorted(want) == sorted(n for n, _ in model_of("llama").named_parameters())
        with torch.device("meta"):
            meta = model_of("llama")
        loaded = smp.transform(meta, weights=export)
        report["weights_diff"] = _max_diff(loaded, {**want, **dict(pretrained.named_buffers())})
        report["weights_held"] = sorted(n for n, _ in loaded.named_parameters())
        return report


def resume(configs: list[dict], path: str, model_only: bool = False, save_to: str | None = None,
           export_to: str | None = None) -> list[list[float]]:
    """For each layout in `configs`: build, load the checkpoint (model + optimizer; only the
    model with `model_only`, the negative control), train steps 2-3; the losses of each.
    `save_to`: the first layout saves what it loaded there (a checkpoint in that layout);
    `export_to`: the last one exports what it loaded there (export_hf)."""
    out = []
    for config in configs:
        with smp.session(config):
            torch.manual_seed(123)  # another init: the checkpoint must overwrite all of it
            model = smp.transform(model_of("llama"))
            opt = _optim(model)
            smp.checkpointing.load(path, model, None if model_only else opt)
            if save_to is not None and not out:
                smp.checkpointing.save(save_to, model, opt)
            if export_to is not None and len(out) == len(configs) - 1:
                smp.checkpointing.export_hf(export_to, model)
            out.append(_train(model, opt, 2, 4))
    return out


def shifted_stage_names(config: dict, path: str) -> str:
    """Negative control: the second stage renumbers its layers from 0 (the bug a split that
    builds stages from a fresh layer list makes); the save must refuse on every rank."""
    with smp.session(config):
        model = smp.transform(model_of("llama"))
        if _pp_rank() == 1:
            stage = model.stages[0]
            slots = own_children(stage.model.layers)
            slots["0"], slots["2"] = slots["2"], slots["0"]
            slots["1"], slots["3"] = slots["3"], slots["1"]
        try:
            smp.checkpointing.save(path, model)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        finally:
            dist.barrier()
        return ""


def weights_into(config: dict, export: str) -> float:
    """`smp.transform(meta model, weights=export)` in this layout vs from_pretrained(export):
    the largest difference over this rank's parameters and buffers (0.0: bitwise)."""
    from transformers import AutoModelForCausalLM

    with smp.session(config):
        pretrained = AutoModelForCausalLM.from_pretrained(export)
        with torch.device("meta"):
            meta = model_of("llama")
        loaded = smp.transform(meta, weights=export)
        return _max_diff(loaded, {**dict(pretrained.named_parameters()), **dict(pretrained.named_buffers())})


def _grouped_optim(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Hugging Face's example scripts' two groups, "no weight decay" for names with "bias" or
    "layer_norm.weight": for Llama no name matches, so that group is empty."""
    named = list(model.named_parameters())
    no_decay = ("bias", "layer_norm.weight")
    return torch.optim.AdamW([
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ], lr=1e-2)


def empty_group_resume(config: dict, path: str) -> dict:
    """Train 2 steps, save (model + an optimizer with an empty group), train 2 more; then load
    the checkpoint into a fresh model and optimizer and train the same 2 steps."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        model = smp.transform(model_of("llama"))
        opt = _grouped_optim(model)
        _train(model, opt, 0, 2)
        smp.checkpointing.save(path, model, opt)
        uninterrupted = _train(model, opt, 2, 4)
    with smp.session(config):
        torch.manual_seed(123)
        model = smp.transform(model_of("llama"))
        opt = _grouped_optim(model)
        smp.checkpointing.load(path, model, opt)
        groups = [len(g["params"]) for g in opt.param_groups]
        return {"uninterrupted": uninterrupted, "resumed": _train(model, opt, 2, 4), "groups": groups}
