"""PEFT (LoRA) models under smp: detection, and saving the adapter as `save_pretrained` does.

A LoRA model goes through smp.transform like any other: the frozen base weights and the
trainable adapters are sharded together (FSDP2 keeps frozen and trainable parameters in one
unit and reduces only the gradients that exist). The optimizer is built from the parameters
with requires_grad, so it holds the adapters only.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Module wrappers that insert a name component: activation checkpointing, torch.compile.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def is_peft_model(model: nn.Module | None) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _adapted_embedding_weights(model: nn.Module) -> set[int]:
    """The frozen base parameters of a LoRA-wrapped input or output embedding (`lm_head` or
    `embed_tokens` in target_modules): PEFT's save_pretrained writes them beside the adapters
    (its `save_embedding_layers="auto"`), so the state handed to it must hold them."""
    from smp.tensor_parallel.lora import is_lora_layer

    base = model.get_base_model() if is_peft_model(model) else model
    layers = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            layers.append(getattr(base, getter)())
        except (AttributeError, NotImplementedError):
            continue
    return {id(p) for layer in layers if layer is not None and is_lora_layer(layer)
            for p in layer.base_layer.parameters()}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) trainable parameters, keyed as the PeftModel's state_dict names them,
    on rank 0 (None elsewhere), and the base weights of an adapted embedding or output head
    (which PEFT saves too). Collective: every rank gathers the same parameters in order; only
    the adapters (and such a head) travel, never the rest of the frozen base model."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    embedding_weights = _adapted_embedding_weights(model)
    for name, p in model.named_parameters():
        if not p.requires_grad and id(p) not in embedding_weights:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if rank0:
            state[_clean(name)] = full.detach().cpu().clone()
    return state if rank0 else None


def save_adapter(model: nn.Module, out_dir: str | os.PathLike) -> None:
    """Write `model`'s adapter to `out_dir` (adapter_config.json + adapter_model.safetensors) as
    PeftModel.save_pretrained does; PeftModel.from_pretrained(base, out_dir) loads it. Collective."""
    state = adapter_state_dict(model)
    if state is not None:
        model.save_pretrained(os.fspath(out_dir), state_dict=state)
    if dist.is_initialized():
        dist.barrier()  # the folder is complete for every rank once any returns


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """What PEFT's `merge_and_unload().state_dict()` gives in one process, from a model smp
    sharded (FSDP, tensor parallel): each LoRA layer's base weight plus B @ A x scaling of every
    adapter, keyed as the base transformers model names them; on rank 0 (None elsewhere).
    Collective: every parameter is gathered whole, in the same order on every rank."""
    from smp.tensor_parallel.lora import is_lora_layer

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    base = model.get_base_model() if is_peft_model(model) else model
    state: dict[str, torch.Tensor] = {}
    lora_layers = {_clean(n): m for n, m in base.named_modules() if is_lora_layer(m)}
    for name, p in base.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        name = _clean(name)
        owner, _, leaf = name.rpartition(".")
        if any(f".{part}." in f".{name}." for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")):
            continue  # folded into their base weight below
        layer_name = owner.removesuffix(".base_layer")
        if owner.endswith("base_layer") and leaf == "weight" and layer_name in lora_layers:
            layer = lora_layers[layer_name]
            full = full.clone()
            for adapter in layer.active_adapters:
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                a = (a.full_tensor() if isinstance(a, DTensor) else a).detach()
                b = (b.full_tensor() if isinstance(b, DTensor) else b).detach()
                delta = b.float() @ a.float()
                full += (delta.T if layer.fan_in_fan_out else delta).to(full.dtype) * layer.scaling[adapter]
        if rank0:
            state[name.replace(".base_layer.", ".")] = full.cpu().clone()
    return state if rank0 else None
