"""`torch.sagemaker.distributed.checkpoint.state_dict_utils`: SMP's FSDP1 state-dict types.

FSDP2 has one state dict (DTensor shards); torch.distributed.checkpoint.state_dict's
get_state_dict / set_state_dict replace `sm_state_dict_type` and `init_optim_state`."""

from smp.sagemaker._guide import unsupported_module_getattr

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.distributed.checkpoint.state_dict_utils", "checkpoints",
    "build the state dict with torch.distributed.checkpoint.state_dict.get_state_dict(model, "
    "optimizer) and restore it with set_state_dict: FSDP2 has one (sharded, DTensor) state dict",
)
