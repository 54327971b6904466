"""`torch.sagemaker.distributed.checkpoint.filesystem`: SMP's reader is DCP's."""

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from smp.sagemaker._guide import unsupported_module_getattr

DistributedFileSystemReader = FileSystemReader
DistributedFileSystemWriter = FileSystemWriter

__getattr__ = unsupported_module_getattr(
    "torch.sagemaker.distributed.checkpoint.filesystem", "checkpoints",
    "use torch.distributed.checkpoint.FileSystemReader / FileSystemWriter",
)
