"""`torch.sagemaker.nn`: SMP's attention kernels. smp keeps the model's own attention."""

from smp.sagemaker.nn import attn, huggingface

__all__ = ["attn", "huggingface"]
