"""`torch.sagemaker.tensor_parallel.transformer`: SMP v2's transformer layer classes.

SMP v2's transform replaced a supported Hugging Face model's layers with these; smp keeps the
model's own layers (docs/migrating-from-smp-v2.md#transform). The classes exist so that a script
can name them (SMP v2 scripts put them in the FSDP1 call's auto-wrap policy or an activation-
checkpointing check); no module of an smp model is one, and building one is refused."""

from __future__ import annotations

from typing import Any

from torch import nn

from smp.sagemaker._guide import not_supported, unsupported_module_getattr

_INSTEAD = ("smp keeps the model's own decoder layers (shard_modules and activation_checkpointing "
            "name them, e.g. LlamaDecoderLayer); build the model from transformers")


class TransformerLayer(nn.Module):
    """SMP v2's transformer layer: named, never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported(f"torch.sagemaker.tensor_parallel.transformer.{type(self).__name__}()", "transform", _INSTEAD)


class TETransformerLayer(TransformerLayer):
    """SMP v2's Transformer Engine layer: named, never built."""


__getattr__ = unsupported_module_getattr("torch.sagemaker.tensor_parallel.transformer", "transform", _INSTEAD)
