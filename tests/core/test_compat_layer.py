"""Other libraries' private names only behind smp/_compat/ (one module per library).

The rule, checked on the source (AST) of every module of smp outside smp/_compat/. A name is
private when it starts with "_" and is not a dunder ("__version__" is public). A foreign library
is torch, transformers, accelerate, trl, peft or torchao. Outside the compat layer:

1. No import of a foreign module whose dotted path has a private part
   (`torch.distributed._functional_collectives`, `torch.utils._pytree`), and no
   `from <foreign module> import _name`.
2. No attribute `obj._name` (read, write or delete), nor `getattr` / `hasattr` / `setattr` /
   `delattr` with a literal "_name", unless `_name` is smp's own: defined by smp itself (a
   function, class, variable, argument or import alias of that name, an attribute set on
   `self` / `cls`, or any name starting with "_smp", smp's marks on other objects) and not one
   of the foreign private names the compat layer reaches. `os._exit`, `sys._current_frames`
   (the root of the chain is an imported module of neither smp nor a foreign library) are not
   foreign. `self._x` / `cls._x` pass when smp defines `_x` somewhere (the class's own state),
   else it is inherited from a foreign base and must be one the compat layer checks (below).
3. No string literal equal to a foreign private name the compat layer reaches (a loop of
   `getattr(module, name)` over such names goes around rule 2).
4. No method definition overriding a foreign private name the compat layer reaches, except
   those the compat layer checks: `_compat.TRAINER_OVERRIDES` (transformers.Trainer methods
   smp's Trainer integration overrides, verified to exist when the Trainer is built) and
   `_compat.EXTENSION_POINTS` (torch's `ParallelStyle._apply`, which a custom tensor-parallel
   style must define). Those names may also be read on `self` and `super()`.

"The foreign private names the compat layer reaches" are read from smp/_compat/ itself (every
private attribute, literal and module part it uses), so the list cannot fall behind it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import smp
from smp import _compat

SMP_DIR = pathlib.Path(smp.__file__).parent
COMPAT = SMP_DIR / "_compat"  # the compat layer: a package, one module per library
FOREIGN = {"torch", "transformers", "accelerate", "trl", "peft", "torchao"}
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}
CHECKED_OVERRIDES = _compat.TRAINER_OVERRIDES | _compat.EXTENSION_POINTS


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _literal_name(node: ast.Call) -> str | None:
    """"_x" of getattr(obj, "_x", ...) and its kin."""
    if isinstance(node.func, ast.Name) and node.func.id in ACCESSORS and len(node.args) > 1:
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def _is_foreign(module: str) -> bool:
    return module.split(".")[0] in FOREIGN


def compat_private_names(source: str) -> set[str]:
    """The private names the compat layer's source reaches on other objects."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= {part for part in node.value.split(".") if _private(part) and part.isidentifier()}
        elif isinstance(node, ast.ImportFrom) and node.module and _is_foreign(node.module):
            names |= {p for p in node.module.split(".") if _private(p)} | {a.name for a in node.names if _private(a.name)}
    return names


def own_private_names(sources: list[str]) -> set[str]:
    """Private names smp defines itself (rule 2), before removing the foreign ones."""
    own: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    own.add(node.attr)
    return {n for n in own if _private(n)}


def _module_roots(tree: ast.AST) -> set[str]:
    """Names bound in the file to a module (or its member) of neither smp nor a foreign library."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top not in FOREIGN and top != "smp":
                    roots.add(a.asname or top)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top not in FOREIGN and top != "smp":
                roots |= {a.asname or a.name for a in node.names}
    return roots


def _chain_root(node: ast.Attribute) -> str | None:
    value = node.value
    while isinstance(value, ast.Attribute):
        value = value.value
    return value.id if isinstance(value, ast.Name) else None


def violations(source: str, filename: str, own: set[str], foreign: set[str]) -> list[str]:
    """Each place in `source` that breaks the rule of this module's docstring."""
    tree = ast.parse(source)
    roots = _module_roots(tree)
    mine = own - foreign
    found = []

    def allowed(name: str) -> bool:
        return name.startswith("_smp") or name in mine

    def on_self(node: ast.Attribute) -> bool:
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            return True
        return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_foreign(a.name) and any(_private(p) for p in a.name.split(".")):
                    flag(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _is_foreign(node.module):
            names = [a.name for a in node.names]
            if any(_private(p) for p in node.module.split(".")) or any(_private(n) for n in names):
                flag(node, f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not allowed(node.attr):
            if on_self(node) and node.attr in CHECKED_OVERRIDES:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and node.attr in own:
                continue  # the class's own state
            if _chain_root(node) in roots:
                continue
            flag(node, f"attribute .{node.attr}")
        elif isinstance(node, ast.Call) and (name := _literal_name(node)) and _private(name) and not allowed(name):
            flag(node, f"{node.func.id}(..., {name!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in foreign:
            if not allowed(node.value) and node.value not in CHECKED_OVERRIDES:
                flag(node, f"string {node.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in foreign:
            if node.name not in CHECKED_OVERRIDES and not allowed(node.name):
                flag(node, f"def {node.name} (overrides a foreign private method)")
    return found


def _smp_sources() -> dict[str, str]:
    return {str(p.relative_to(SMP_DIR.parent)): p.read_text() for p in sorted(SMP_DIR.rglob("*.py"))
            if COMPAT not in p.parents}


def _compat_source() -> str:
    return "\n".join(p.read_text() for p in sorted(COMPAT.glob("*.py")))


def _rule_inputs() -> tuple[set[str], set[str]]:
    sources = _smp_sources()
    return own_private_names(list(sources.values())), compat_private_names(_compat_source())


def test_no_private_foreign_name_outside_the_compat_layer():
    own, foreign = _rule_inputs()
    found = [v for name, source in _smp_sources().items() for v in violations(source, name, own, foreign)]
    assert not found, "reach these through smp/_compat/:\n" + "\n".join(found)


def test_the_rule_catches_each_way_around_it():
    """Negative controls: each snippet reaches a private torch / transformers / accelerate name
    outside the compat layer and must be flagged; the last ones are smp's own or stdlib's."""
    own, foreign = _rule_inputs()
    caught = {
        "from torch.distributed._functional_collectives import all_gather_single_autograd": "from torch.distributed._functional_collectives",
        "import torch.distributed._functional_collectives as funcol": "import torch.distributed._functional_collectives",
        "from torch.distributed.tensor.placement_types import _StridedShard": "from torch.distributed.tensor.placement_types",
        "import torch\ntorch._C._current_graph_task_id()": "attribute ._C",
        "def f(mesh):\n    return mesh._flatten('dp')": "attribute ._flatten",
        "def f(accelerator, dl):\n    accelerator._dataloaders.append(dl)": "attribute ._dataloaders",
        "def f(model):\n    model._is_accelerate_prepared = True": "attribute ._is_accelerate_prepared",
        "def f(mesh):\n    return getattr(mesh, '_pg_registry', None)": "getattr(..., '_pg_registry')",
        "HOOKS = ('_forward_hooks', '_backward_hooks')": "string '_forward_hooks'",
        "class A:\n    def f(self):\n        return self._train_batch_size": "attribute ._train_batch_size",
        "class T:\n    def _get_backend(self, device):\n        pass": "def _get_backend",
        "class T:\n    def f(self):\n        return self._dataloaders": "attribute ._dataloaders",
        "class T:\n    def f(self):\n        return super()._flatten('dp')": "attribute ._flatten",
    }
    for snippet, expected in caught.items():
        found = violations(snippet, "snippet.py", own, foreign)
        assert any(expected in v for v in found), (snippet, found)
    allowed = [
        "import os\nos._exit(1)",
        "import sys\nsys._current_frames()",
        "class A:\n    def __init__(self):\n        self._anything = 1\n\n    def f(self):\n        return self._anything",
        "from smp import _compat\n_compat.in_backward()",
        "def f(module):\n    module._smp_original = module.forward",
        "from torch.distributed.tensor.parallel import ParallelStyle\nclass S(ParallelStyle):\n    def _apply(self, module, mesh):\n        return module",
        "class T:\n    def _track_num_input_tokens(self, inputs):\n        super()._track_num_input_tokens(inputs)",
    ]
    for snippet in allowed:
        assert violations(snippet, "snippet.py", own | own_private_names([snippet]), foreign) == [], snippet


def test_the_compat_layer_knows_the_names_the_issue_listed():
    """The foreign names read from smp/_compat/ include those smp is known to need."""
    _, foreign = _rule_inputs()
    assert {"_functional_collectives", "_pytree", "_python_dispatch", "_traverse", "_internal", "_flatten",
            "_pg_registry", "_set_pg_timeout", "_fsdp_param_group", "_forward_hooks", "_dataloaders",
            "_StridedShard"} <= foreign
    assert {"_move_model_to_device", "_track_num_input_tokens"} <= CHECKED_OVERRIDES


def test_a_feature_the_installed_torch_lacks_is_refused_naming_both_versions(monkeypatch):
    """Sequence parallel on torch 2.9 (no DTensor rule for aten.alias): refused when used, with
    the key, the version it needs and the installed one; `import smp` itself is unaffected."""
    from smp.errors import UnsupportedVersionError

    from smp._compat import versions

    monkeypatch.setattr(versions, "torch_version", lambda: (2, 9))
    with pytest.raises(UnsupportedVersionError) as caught:
        _compat.check_sequence_parallel()
    message = str(caught.value)
    assert "tensor_parallel.sequence_parallel" in message and ">= 2.11" in message
    assert f"installed: torch {_compat.installed('torch')}" in message
    assert isinstance(caught.value, smp.Error)
    monkeypatch.setattr(versions, "torch_version", lambda: (2, 11))
    _compat.check_sequence_parallel()  # supported there: no error
