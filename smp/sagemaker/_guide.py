"""Where smp.sagemaker points a script that uses SMP v2 in a way smp cannot follow, and the
errors that say so. Every message names a section of the migration guide."""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from smp.errors import Error

GUIDE = "docs/migrating-from-smp-v2.md"


def section(anchor: str) -> str:
    return f"{GUIDE}#{anchor}"


class NotSupportedBySmp(Error, NotImplementedError):
    """An SMP v2 name smp does not implement; the message says what to use instead."""


class MigrationError(Error, RuntimeError):
    """An SMP v2 script step that cannot work on smp as written; the message says the edit."""


def not_supported(name: str, anchor: str, instead: str) -> NoReturn:
    raise NotSupportedBySmp(f"{name} (SMP v2) is not implemented by smp: {instead} (see {section(anchor)})")


def unsupported_module_getattr(module: str, anchor: str, instead: str) -> Callable[[str], Any]:
    """A module `__getattr__`: any SMP name looked up in `module` raises NotSupportedBySmp
    (dunder lookups keep Python's AttributeError, which import machinery and tools expect)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        not_supported(f"{module}.{name}", anchor, instead)

    return __getattr__
