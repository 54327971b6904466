"""Rank-side cases: a real pretrained model (tests/models/real_weights.py) built on the meta device and
filled by `smp.transform(model, weights=folder)`, trained one step against `from_pretrained` of
the same folder in one process."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import smp
import smp.pipeline
from smp.testing.distributed import full_tensor, local_rows, local_tensor, world_mean
from tests.models.real_weights import token_batch

ROWS, SEQ = 4, 32


def fine_tune_step(config: dict, folder: str, broken: str | None = None) -> dict:
    """Loss and largest gradient gap of one step vs one process; the reference's loss too.
    broken="unloaded_norm": the final norm is put back to its init value after the load (a
    tensor the load missed), which the comparison must catch."""
    ids = token_batch(folder, ROWS, SEQ)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    # tied copies (lm_head.weight is embed_tokens.weight) under both names: a pipeline's last
    # stage holds the head's copy, with the tied gradient summed into it
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    with smp.session(config):
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
        model = smp.transform(model, weights=folder)
        if broken == "unloaded_norm":
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name == "model.norm.weight":
                        local_tensor(p).fill_(1.0)
        if smp.state.pp_size > 1:
            loss = smp.pipeline.step(model, local_rows(ids))
        else:
            loss = model(input_ids=local_rows(ids), labels=local_rows(ids)).loss
            loss.backward()
        grad_gap = 0.0
        for name, p in model.named_parameters():
            gap = float("inf") if p.grad is None else float((full_tensor(p.grad) - ref_grads[name]).abs().max())
            grad_gap = max(grad_gap, gap)
        held = len(list(model.named_parameters()))
        return {"loss": world_mean(loss), "ref_loss": float(ref_loss), "grad_gap": grad_gap, "params_held": held}
