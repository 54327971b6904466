"""Depth and cycles of smp's import graph, read from the `import` statements of smp/*.py.

Two graphs: every import statement (those inside functions too: deferred imports hide a cycle
without removing it) and module-level ones only (what runs at `import smp`). A cycle is a
strongly connected set of more than one module; depth is the longest chain of imports between
those sets. Run: python scripts/import_graph.py [smp folder]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(name: str, path: Path, known: set[str], top_level_only: bool) -> set[str]:
    """The smp modules `name` imports (a `from a import b` counts a.b when that is a module)."""
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:  # a template (smp/sagemaker's entry point), not a module
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # imports under module-level `if`/`try` still run at import
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from smp import runtime` imports smp.runtime; the package counts only for names
            # that are not modules (every import runs the package's __init__ anyway)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def depth(graph: dict[str, set[str]], components: list[list[str]]) -> int:
    """Longest chain of imports (in modules) through the graph with each cycle collapsed."""
    component_of = {m: i for i, c in enumerate(components) for m in c}
    longest: dict[int, int] = {}

    def chain(i: int) -> int:
        if i not in longest:
            longest[i] = 0
            nexts = {component_of[w] for m in components[i] for w in graph[m]} - {i}
            longest[i] = 1 + max((chain(j) for j in nexts), default=0)
        return longest[i]

    return max(chain(i) for i in range(len(components)))


def report(root: Path) -> None:
    names = module_names(root)
    for label, top in (("all import statements", False), ("module-level imports", True)):
        graph = {n: imported(n, p, set(names), top) for n, p in names.items()}
        components = strongly_connected(graph)
        cycles = [c for c in components if len(c) > 1]
        print(f"{label}: {len(names)} modules, {sum(map(len, graph.values()))} edges, depth {depth(graph, components)}, "
              f"{len(cycles)} cycles ({sum(map(len, cycles))} modules in them)")
        for c in sorted(cycles, key=len, reverse=True):
            print(f"  cycle of {len(c)}: {', '.join(c[:12])}{' ...' if len(c) > 12 else ''}")


if __name__ == "__main__":
    report(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "smp"))
