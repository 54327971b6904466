"""Import hooks of smp.sagemaker, installed when smp.sagemaker is imported (never by `import smp`).

1. Any `smp.sagemaker.X` module that does not exist (SMP v2 had it; smp does not implement it)
   raises NotSupportedBySmp naming the guide section, at any depth, instead of a bare
   ModuleNotFoundError. Names inside existing modules do the same through each module's
   `__getattr__`.
2. Opt-in, by `import smp.sagemaker.as_torch_sagemaker`: `torch.sagemaker` and every
   `torch.sagemaker.X` resolve to the same smp.sagemaker modules, so that a script's many SMP v2
   imports (spread over several files) port with that one line.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

from smp.sagemaker._guide import not_supported

OURS, THEIRS = "smp.sagemaker", "torch.sagemaker"

# The guide section for a missing module, by its path under smp.sagemaker (longest prefix wins).
_SECTIONS = {
    "nn": ("flash-attention", "keep the model's own attention (attn_implementation='sdpa')"),
    "distributed.checkpoint": ("checkpoints", "save and load with state_dict_saver / state_dict_loader"),
    "checkpoint": ("checkpoints", "smp implements torch.sagemaker.checkpoint.utils"),
    "moe": ("moe", "MoE options go under the config's `moe:` section"),
    "tensor_parallel": ("transform", "smp applies tensor parallelism to the model's own modules"),
    "": ("names", "the guide's table lists every SMP v2 name with its smp equivalent"),
}


def _refuse(fullname: str) -> None:
    rest = fullname[len(OURS) + 1:]
    key = max((k for k in _SECTIONS if rest == k or rest.startswith(k + ".") or not k), key=len)
    anchor, instead = _SECTIONS[key]
    not_supported(f"{THEIRS}.{rest} (module)", anchor, instead)


class _MissingModules(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: reached only when no other finder has the module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.startswith(OURS + "."):
            _refuse(fullname)
        return None


class _Existing(importlib.abc.Loader):
    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: Any) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        pass


class _TorchSagemakerAlias(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: torch.sagemaker[.X] is smp.sagemaker[.X] (the same module)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != THEIRS and not fullname.startswith(THEIRS + "."):
            return None
        module = importlib.import_module(OURS + fullname[len(THEIRS):])
        return importlib.util.spec_from_loader(fullname, _Existing(module))


def install_missing_module_errors() -> None:
    if not any(isinstance(f, _MissingModules) for f in sys.meta_path):
        sys.meta_path.append(_MissingModules())


def install_torch_sagemaker_alias() -> None:
    if not any(isinstance(f, _TorchSagemakerAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchSagemakerAlias())
