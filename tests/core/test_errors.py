"""One error hierarchy under `smp.Error`, and an import graph whose dependencies point one way."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import smp
from smp import errors
from smp.reliability import guard
from smp.reliability.finite import NonFiniteGradientError

SMP_DIR = pathlib.Path(smp.__file__).parent
# The modules that read smp's global state (smp.runtime) for the user; everything below them
# takes plain values.
RUNTIME_READERS = {"smp", "smp.transform", "smp.training", "smp.checkpointing", "smp.tensor_parallel", "smp.cli",
                   "smp.sagemaker",
                   # the accelerate adapter and the Hugging Face export the integrations hand the user
                   "smp.integrations.accelerate", "smp.integrations.saving",
                   # `tsm.init` and `tsm.state`: smp.sagemaker's entry points, in modules of their own
                   "smp.sagemaker._session", "smp.sagemaker._state_view",
                   # smp.checkpointing.save / export_hf, in a module of their own so that Checkpointer
                   # (inside the package) calls them without importing the package
                   "smp.checkpointing.api"}


def test_every_error_is_an_smp_error_and_its_builtin():
    assert issubclass(errors.ConfigError, smp.Error) and issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.CheckpointError, smp.Error)
    assert not issubclass(errors.CheckpointError, errors.ConfigError)  # its own kind
    assert not issubclass(errors.CheckpointError, ValueError)
    assert issubclass(errors.PlanError, smp.Error) and issubclass(errors.PlanError, ValueError)
    assert not issubclass(errors.PlanError, errors.ConfigError)
    assert issubclass(errors.UsageError, smp.Error) and issubclass(errors.UsageError, ValueError)
    assert not issubclass(errors.UsageError, errors.ConfigError)
    assert issubclass(errors.PeerFailure, smp.Error) and issubclass(errors.PeerFailure, RuntimeError)
    assert issubclass(NonFiniteGradientError, smp.Error) and issubclass(NonFiniteGradientError, FloatingPointError)
    assert smp.Error.__bases__ == (Exception,)


def test_errors_are_importable_from_where_they_were():
    from smp.checkpointing.format.metadata import CheckpointError
    from smp.config import ConfigError

    assert smp.ConfigError is ConfigError is errors.ConfigError
    assert smp.CheckpointError is smp.checkpointing.CheckpointError is CheckpointError is errors.CheckpointError
    assert smp.PeerFailure is guard.PeerFailure is errors.PeerFailure
    assert smp.NonFiniteGradientError is NonFiniteGradientError


def _imports(path: pathlib.Path, module: str, modules: set[str]) -> set[str]:
    """The smp modules `path` imports by name (at the top or inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for a in node.names:
                full = f"{base}.{a.name}"
                found |= {full} if full in modules else {base} if base in modules else set()
    return found - {module}


def _import_graph() -> dict[str, set[str]]:
    paths = {}
    for path in SMP_DIR.rglob("*.py"):
        name = ".".join(("smp",) + path.relative_to(SMP_DIR).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def test_import_graph_has_no_cycle():
    """(A package's own __init__ is imported before its modules by Python itself: not an edge.)"""
    graph = _import_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):] + [name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_only_the_public_entry_points_read_the_runtime():
    readers = {name for name, deps in _import_graph().items() if "smp.runtime" in deps}
    assert readers <= RUNTIME_READERS, readers - RUNTIME_READERS


def test_every_module_imports_in_a_fresh_interpreter():
    code = (
        "import importlib, pkgutil, smp\n"
        "for m in pkgutil.walk_packages(smp.__path__, 'smp.'):\n"
        "    if m.name != 'smp.__main__':\n"
        "        importlib.import_module(m.name)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
