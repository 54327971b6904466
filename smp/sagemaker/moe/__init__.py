"""`torch.sagemaker.moe`: SMP's mixture-of-experts configuration."""

from smp.sagemaker.moe import moe_config, moe_layer
from smp.sagemaker.moe.moe_config import MoEConfig

__all__ = ["MoEConfig", "moe_config", "moe_layer"]
