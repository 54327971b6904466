"""`import smp.sagemaker.as_torch_sagemaker`: from here on, `import torch.sagemaker as tsm` and
every `from torch.sagemaker.X import Y` give smp.sagemaker's modules, so an SMP v2 script whose
SMP imports are spread over several files ports with this one line at the top of its entry
point (docs/migrating-from-smp-v2.md#launch). Only this import installs the alias."""

from smp.sagemaker._imports import install_torch_sagemaker_alias

install_torch_sagemaker_alias()
