"""Installed versions, and the error for a feature the installed version lacks."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import torch

from smp.errors import UnsupportedVersionError

def installed(package: str) -> str:
    """The installed version of `package` ("not installed" when it is not)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch: 2.11.0+cu130 -> (2, 11)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def unsupported(feature: str, package: str = "torch", needs: str = "", fix: str = "") -> UnsupportedVersionError:
    """The error for `feature`, which the installed `package` cannot provide."""
    wanted = f" needs {package} {needs}" if needs else f" is not available in {package} {installed(package)}"
    tail = f" {fix}" if fix else f" Install a {package} version smp supports (see docs/compatibility.md)."
    return UnsupportedVersionError(f"{feature}{wanted} (installed: {package} {installed(package)}).{tail}")


def require_torch(version: tuple[int, int], feature: str, why: str) -> None:
    """Raise UnsupportedVersionError naming `feature` when the running torch is older than
    `version` (major, minor); `why` says what fails there and what to do instead."""
    if torch_version() < version:
        raise unsupported(feature, needs=f">= {version[0]}.{version[1]}", fix=why)


def _private(module: str, name: str) -> Any:
    """`module.name`, or None when this version lacks either."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
