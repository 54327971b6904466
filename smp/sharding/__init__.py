from smp.sharding.blocks import find_blocks
from smp.sharding.delayed_init import has_meta_tensors, materialize_meta_model
from smp.sharding.fsdp import apply_fsdp

__all__ = ["apply_fsdp", "find_blocks", "has_meta_tensors", "materialize_meta_model"]
