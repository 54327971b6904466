"""`torch.sagemaker.moe.moe_layer.MoELayer`: SMP v2's mixture-of-experts layer.

smp keeps the model's own MoE blocks (expert parallelism shards their experts); the class exists
so that a script can name it (SMP v2 scripts check `isinstance(m, MoELayer)` to checkpoint MoE
layers); no module of an smp model is one, and building one is refused."""

from __future__ import annotations

from typing import Any

from torch import nn

from smp.sagemaker._guide import not_supported, unsupported_module_getattr

_INSTEAD = ("smp keeps the model's own MoE blocks and shards their experts with "
            "expert_parallel_degree; options go under the config's `moe:` section")


class MoELayer(nn.Module):
    """SMP v2's MoE layer: named, never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("torch.sagemaker.moe.moe_layer.MoELayer()", "moe", _INSTEAD)


__getattr__ = unsupported_module_getattr("torch.sagemaker.moe.moe_layer", "moe", _INSTEAD)
