"""`torch.sagemaker.grad_norm.clip_grad_norm_`: smp's, which reduces the norm over every shard
and tensor-parallel rank (equal to torch's on the unsharded model)."""

from smp.training import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
