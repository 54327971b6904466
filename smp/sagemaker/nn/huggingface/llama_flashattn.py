"""`torch.sagemaker.nn.huggingface.llama_flashattn.LlamaFlashAttention` (not in smp)."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.nn._instead import FLASH_ATTENTION_INSTEAD

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.nn.huggingface.llama_flashattn", "flash-attention", FLASH_ATTENTION_INSTEAD
)
