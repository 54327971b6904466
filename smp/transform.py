"""`smp.transform(model)`: the parallelism recipe, in the order the techniques must compose."""

from __future__ import annotations

from torch import nn

from smp import runtime
from smp.config import ConfigError
from smp.mesh import fsdp_mesh
from smp.sharding import apply_fsdp, find_blocks, has_meta_tensors, materialize_meta_model


def transform(model: nn.Module) -> nn.Module:
    """Apply the configured parallelism to `model` in place and return it.

    Build the optimizer after this call, from the returned module's parameters, as with FSDP2.
    """
    st = runtime.current()
    cfg = st.config
    if not isinstance(model, nn.Module):
        raise TypeError(f"smp.transform expects an nn.Module, got {type(model).__name__}")
    if cfg.tensor_parallel_degree > 1:
        raise ConfigError(
            f"tensor_parallel_degree={cfg.tensor_parallel_degree}: tensor parallelism is not "
            "available in this build of smp yet; set tensor_parallel_degree: 1"
        )
    on_meta = has_meta_tensors(model)
    if not on_meta:
        model.to(st.device)

    blocks = find_blocks(model, cfg.shard_modules)
    # FSDP goes last: it wraps whatever the earlier steps (TP, checkpointing) made of the blocks.
    apply_fsdp(model, fsdp_mesh(st.mesh, st.dims), cfg, blocks)

    if on_meta:
        init_device = "cpu" if cfg.cpu_offload else st.device
        materialize_meta_model(model, init_device, cfg.random_seed)
    return model
