"""Tensor parallelism: plans as data, applied with torch.distributed.tensor.parallel."""

from smp.tensor_parallel.apply import apply_tensor_parallel

__all__ = ["apply_tensor_parallel"]
