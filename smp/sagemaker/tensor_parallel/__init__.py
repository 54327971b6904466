"""`torch.sagemaker.tensor_parallel`: SMP v2's own transformer implementation. smp keeps the
model's own modules (tensor parallel applies a plan to them), so its layer classes exist to be
named (e.g. in an auto-wrap policy that the removed FSDP1 call took) and match no module."""

from smp.sagemaker._guide import unsupported_module_getattr
from smp.sagemaker.tensor_parallel import transformer

__all__ = ["transformer"]

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.tensor_parallel", "transform",
    "smp applies tensor parallelism to the model's own modules (tensor_parallel_degree and a plan)",
)
