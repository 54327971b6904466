"""What replaces SMP's attention modules."""

FLASH_ATTENTION_INSTEAD = (
    "keep the model's own attention on torch.nn.functional.scaled_dot_product_attention, which "
    "dispatches to flash / memory-efficient kernels (transformers: attn_implementation='sdpa')"
)
