"""LoRA (PEFT) under tensor parallel (x FSDP) vs the same PeftModel in one process; run on every
rank of a RankPool, each case returns plain data.

The adapters start random (`init_lora_weights=False`: PEFT's default B = 0 would leave A's
gradient 0 and hide a wrong reduction), dropout 0; adapters on column-wise (q, v, gate) and
row-wise (o, down) layers of a tiny Llama.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

import smp
from smp.integrations.peft import merged_state_dict, save_adapter
from smp.tensor_parallel import lora
from smp.tensor_parallel.registry import PARTIAL_GRAD, Assignment
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import random_batch, tiny_llama

tp_apply = importlib.import_module("smp.tensor_parallel.apply")  # the module (the package exports the function)

VOCAB, BATCH, SEQ = 128, 4, 16
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
HEAD_TARGETS = [*TARGETS, "lm_head"]  # and the output head (one layer, untied from the embedding)


def build_peft(seed: int = 0, targets: list[str] = TARGETS) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(base, config)


class _LocalGrad(torch.autograd.Function):
    """Identity into a Replicate DTensor whose backward hands back this rank's share of the
    gradient unreduced (a negative control's broken sum)."""

    @staticmethod
    def forward(ctx, x, mesh):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return (grad.to_local() if isinstance(grad, DTensor) else grad), None


class _GatheredUnreduced(ColwiseParallel):
    """lora_B beside a gathered layer split column-wise with its output gathered (or left split
    by `output`), and lora_A's output gradient left as this rank's share."""

    def __init__(self, output=Replicate(), use_local_output: bool = True):
        super().__init__(input_layouts=Replicate(), output_layouts=output, use_local_output=use_local_output)

    def _apply(self, module, device_mesh):
        module.register_forward_pre_hook(lambda _m, args: (_LocalGrad.apply(args[0], device_mesh),))
        return super()._apply(module, device_mesh)


class _SequenceLocal(ParallelStyle):
    """lora_A beside a head under sequence parallel run as a plain module on this rank's
    sequence shard: its gradient left as this rank's share, not summed over the tp ranks."""

    def _apply(self, module, device_mesh):
        module.register_forward_pre_hook(lambda _m, args: (args[0].to_local(),))
        module.register_forward_hook(
            lambda _m, _args, out: DTensor.from_local(out, device_mesh, [Shard(1)], run_check=False))
        return module


def _head_unsummed(styles):
    """head_adapter_styles, with lora_A's gradient left as this rank's share: under sequence
    parallel not summed over the sequence shards, else not summed by lora_B's input."""
    def wrapped(base_style):
        style_a, style_b = styles(base_style)
        if style_a is not None:
            return _SequenceLocal(), style_b
        return None, _GatheredUnreduced(style_b.output_layouts[0], style_b.use_local_output)
    return wrapped


def _q_a_summed(expand):
    """expand_plan, with the adapters of MLA's whole q_a_proj taken as partial: their gradient
    (already whole) summed over the tp ranks."""
    def wrapped(model, *args, **kwargs):
        expanded = expand(model, *args, **kwargs)
        for a in list(expanded.assignments):
            if a.name.endswith("q_a_proj") and lora.is_lora_layer(a.module):
                for part in ("lora_A", "lora_B"):
                    for key, sub in getattr(a.module, part).items():
                        expanded.assignments.append(Assignment(f"{a.name}.{part}.{key}", sub, PARTIAL_GRAD))
        return expanded
    return wrapped


@contextlib.contextmanager
def _corrupted(kind: str | None) -> Iterator[None]:
    """`unreduced`: a row-wise layer's lora_A output is left as this rank's partial sum;
    `unfrozen`: the frozen parameters sequence parallel re-creates are left trainable;
    `gathered_unreduced`: beside a gathered layer, lora_B split with its output gathered and
    lora_A's gradient left as this rank's share; `packed_contiguous`: beside a packed layer,
    lora_B split in contiguous rows, not each packed part's; `mla_q_a_summed`: MLA's q_a_proj
    adapters' whole gradient summed over the ranks as if partial; `mla_rope_on_base`: MLA's
    kv_a_proj_with_mqa rotary-gradient sum hooked on its base layer, the adapters beside it
    getting each rank's partial gradient; `head_unsummed`: beside an output head under sequence
    or loss parallel, lora_A's gradient left as this rank's share."""
    saved, keep_frozen, expand = lora.adapter_styles, tp_apply._keep_frozen, tp_apply.expand_plan
    placement, head_styles = lora.placement, lora.head_adapter_styles
    if kind in ("unreduced", "gathered_unreduced", "packed_contiguous"):
        def styles(base, sequence_parallel=False, parts=1):
            if kind == "unreduced" and base == lora.ROWWISE:
                return RowwiseParallel(input_layouts=Shard(-1), output_layouts=Partial()), None
            if kind == "gathered_unreduced" and base == lora.WHOLE and not sequence_parallel:
                return None, _GatheredUnreduced()
            if kind == "packed_contiguous" and base == lora.PACKED:
                return None, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))
            return saved(base, sequence_parallel, parts)
        lora.adapter_styles = styles
    elif kind == "unfrozen":
        tp_apply._keep_frozen = lambda model, frozen: None
    elif kind == "mla_q_a_summed":
        tp_apply.expand_plan = _q_a_summed(expand)
    elif kind == "mla_rope_on_base":
        lora.placement = lambda name, style, base_style: (
            (lora.WHOLE, 1, False) if style in lora.OWN_OUTPUT_HOOK else placement(name, style, base_style))
    elif kind == "head_unsummed":
        lora.head_adapter_styles = _head_unsummed(head_styles)
    elif kind is not None:
        raise ValueError(kind)
    try:
        yield
    finally:
        lora.adapter_styles, tp_apply._keep_frozen, tp_apply.expand_plan = saved, keep_frozen, expand
        lora.placement, lora.head_adapter_styles = placement, head_styles


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def equivalence(config: dict, out_dir: str, steps: int = 2, corrupt: str | None = None,
                targets: list[str] = TARGETS) -> dict:
    """Loss and every adapter gradient over `steps` SGD steps vs one process; then the saved
    adapter folder and the merged weights vs PEFT's own in one process (rank 0). `targets`:
    the adapted modules (PEFT's target_modules)."""
    with smp.session(config):
        reference = build_peft(targets=targets)
        model = copy.deepcopy(reference)
        ids = random_batch(BATCH, SEQ, VOCAB, seed=5)
        ref_opt = torch.optim.SGD(_trainable(reference).values(), lr=0.5)
        ref_losses, ref_grads = [], []
        for _ in range(steps):
            loss = reference(input_ids=ids, labels=ids).loss
            loss.backward()
            ref_losses.append(float(loss.detach()))
            ref_grads.append({n: p.grad.clone() for n, p in _trainable(reference).items()})
            ref_opt.step()
            ref_opt.zero_grad()

        with _corrupted(corrupt):
            model = smp.transform(model)
        opt = torch.optim.SGD(_trainable(model).values(), lr=0.5)
        rows = local_rows(ids)
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": ref_losses, "frozen_grads": 0,
                  "adapters": len(_trainable(model))}
        for step in range(steps):
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - ref_losses[step]))
            report["frozen_grads"] += sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
            grads = {n: full_tensor(p.grad) for n, p in _trainable(model).items()}
            report["grad_diff"] = max(report["grad_diff"], max(
                float((grads[n] - ref_grads[step][n]).abs().max()) for n in ref_grads[step]))
            opt.step()
            opt.zero_grad()

        ours, theirs = os.path.join(out_dir, "smp"), os.path.join(out_dir, "peft")
        save_adapter(model, ours)
        merged = merged_state_dict(model)
        if smp.state.rank == 0:
            reference.save_pretrained(theirs)
            report.update(_compare_folders(ours, theirs, targets))
            expected = reference.merge_and_unload().state_dict()
            report["merged_keys_equal"] = sorted(merged) == sorted(expected)
            report["merged_diff"] = max(float((merged[k] - expected[k]).abs().max()) for k in expected)
        return report


def _compare_folders(ours: str, theirs: str, targets: list[str]) -> dict:
    """The adapter files (tensors by name) and what PeftModel.from_pretrained loads from ours."""
    from peft import PeftModel
    from safetensors.torch import load_file

    a = load_file(os.path.join(ours, "adapter_model.safetensors"))
    b = load_file(os.path.join(theirs, "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(build_peft(seed=1, targets=targets).get_base_model(), ours)
    reloaded = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    return {
        "adapter_keys_equal": sorted(a) == sorted(b),
        "adapter_diff": max(float((a[k] - b[k]).abs().max()) for k in b),
        "reloaded_adapters": len(reloaded),
    }


def transform_error(config: dict, quantized: bool = False) -> str:
    """The error smp.transform raises for the LoRA model ('' if none); `quantized`: its config
    says bitsandbytes 4-bit (QLoRA), as from_pretrained(quantization_config=...) leaves it."""
    with smp.session(config):
        model = build_peft()
        if quantized:
            model.get_base_model().config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        try:
            smp.transform(model)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""
