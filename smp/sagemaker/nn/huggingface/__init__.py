"""`torch.sagemaker.nn.huggingface`: SMP's attention for transformers models (not in smp)."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.nn._instead import FLASH_ATTENTION_INSTEAD
from smp.sagemaker.nn.huggingface import llama_flashattn

__all__ = ["llama_flashattn"]

__getattr__ = unsupported_module_getattr("torch.sagemaker.nn.huggingface", "flash-attention", FLASH_ATTENTION_INSTEAD)
