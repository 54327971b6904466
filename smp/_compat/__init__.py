"""The one door to other libraries' private names (torch, transformers, accelerate).

Every access smp makes to a name those libraries do not document (an attribute or module whose
name starts with "_") goes through a function here, one module per library (`torch.py`,
`transformers.py`, `accelerate.py`; `versions.py` holds the version checks and the error), so
that a new release breaks one file, not fifty. Each accessor uses the public API where the
running version has one, says which versions it was checked on, and, where neither a public nor
the private name exists, raises `UnsupportedVersionError` naming the feature and the installed
version. That happens when the feature is used: importing this package (and so `import smp`)
works on every torch smp supports, whatever is missing. tests/core/test_compat_layer.py checks that no
other module of smp goes around it. The rest of smp imports the names from here
(`from smp._compat import full_tensor`).

"Checked on" ranges are the versions smp's test suite ran on: torch 2.9.1, 2.11.0, 2.13.0,
2.14.1; transformers 5.17, 5.23; accelerate 1.15.
"""

from smp._compat.versions import (  # noqa: F401
    installed,
    torch_version,
    unsupported,
    require_torch,
    _private,
)
from smp._compat.torch import (  # noqa: F401
    tree_leaves,
    tree_map_only,
    op_name,
    OpOverload,
    OpOverloadPacket,
    SDPA_FUNCTIONS,
    in_backward,
    at_backward_end,
    apply_to_tensors,
    view_base,
    version_counter,
    dtensor_local,
    dtensor_spec,
    full_tensor,
    dtensor_from_spec,
    own_parameters,
    own_buffers,
    non_persistent_buffers,
    own_children,
    add_parameter_slot,
    without_hooks,
    apply_style,
    style_io_functions,
    check_sequence_parallel,
    default_store,
    group_is_alive,
    set_group_timeout,
    group_timeout,
    flatten_mesh,
    drop_cached_groups,
    all_gather_autograd,
    all_to_all_autograd,
    strided_shard_type,
    strided_shard,
    fake_store,
    fsdp_unit_params,
    fsdp_sharded_data,
    fsdp_reshard_after_forward_onto,
    root_mesh,
    set_element,
    checkpoint_wrapper_module,
    sharded_tensor_type,
    patch_optimizer_loader_group,
    TorchDispatchMode,
)
from smp._compat.torchao import float8_castable_weight  # noqa: F401
from smp._compat.transformers import (  # noqa: F401
    supports_attention_interface,
    set_config_attention,
    init_weights_function,
    module_init_function,
    clear_initialized_marks,
    keys_to_ignore_on_load,
    no_split_modules,
    model_tp_plan,
    TRAINER_OVERRIDES,
    EXTENSION_POINTS,
    check_trainer_overrides,
    trainer_batch_size,
    CheckpointConversion,
)
from smp._compat.accelerate import (  # noqa: F401
    is_prepared,
    mark_prepared,
    track_dataloader,
    track_scheduler,
    prepared_optimizers,
    scheduler_step_count,
    wrap_accelerator_prepare,
)
