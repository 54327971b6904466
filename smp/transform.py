"""`smp.transform(model)`: the parallelism recipe, in the order the techniques must compose."""

from __future__ import annotations

from torch import nn

from smp import runtime
from smp.activations import apply_activation_checkpointing, apply_activation_offloading
from smp.sharding import apply_fsdp, find_blocks, has_meta_tensors, materialize_meta_model
from smp.sharding.gradient_sync import gradient_sync_mesh, install_gradient_sync
from smp.tensor_parallel import apply_tensor_parallel


def transform(
    model: nn.Module, *, tp_plan: dict[str, str] | None = None, materialize: bool = True
) -> nn.Module:
    """Apply the configured parallelism to `model` in place and return it.

    Build the optimizer after this call, from the returned module's parameters, as with FSDP2.
    `tp_plan` (module-name pattern -> style) overrides the model's own tensor-parallel plan.
    """
    st = runtime.current()
    cfg = st.config
    if not isinstance(model, nn.Module):
        raise TypeError(f"smp.transform expects an nn.Module, got {type(model).__name__}")
    on_meta = has_meta_tensors(model)
    if not on_meta:
        model.to(st.device)

    # 1. Tensor parallel first: it rewrites the layers that everything after wraps.
    if st.dims.tp > 1:
        apply_tensor_parallel(model, st.mesh["tp"], cfg, tp_plan)
    blocks = find_blocks(model, cfg.shard_modules)
    # 2. Activation checkpointing / offloading wrap the blocks before FSDP sees them, so that
    #    recompute runs inside FSDP's unshard/reshard of each block.
    blocks = apply_activation_checkpointing(model, blocks, cfg)
    apply_activation_offloading(model, blocks, cfg)
    # 3. FSDP last: one unit per block, then the root. (1-D over dp_shard when smp's hook, not
    #    native HSDP, syncs the replicas: gradient_sync.cross_replica.)
    apply_fsdp(model, gradient_sync_mesh(st.mesh, st.dims, cfg), cfg, blocks)
    # 4. Gradient sync: smp_collectives' collectives on every FSDP unit, when configured.
    install_gradient_sync(model, st, cfg)

    # materialize=False leaves a meta model on meta: shapes and placements only (`smp plan`).
    if on_meta and materialize:
        init_device = "cpu" if cfg.cpu_offload else st.device
        materialize_meta_model(model, init_device, cfg.random_seed)
    return model
