"""The import graph of ``vllm_hybrid``, read from the source (no import runs),
for the layer tests (``test_layering.py``, ``test_package_layers.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_hybrid"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _imports(
    tree: ast.Module, module: str, is_package: bool
) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every import in ``tree`` (function-local
    imports included: they still run), except under ``if TYPE_CHECKING``;
    ``names`` is empty for ``import module``."""
    found: list[tuple[str, tuple[str, ...]]] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            found.append((base, tuple(a.name for a in node.names)))
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> modules of the package it imports. ``from pkg import sub``
    counts as importing ``pkg.sub`` only when ``sub`` is a module."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        tree = ast.parse(path.read_text())
        for base, names in _imports(tree, name, path.name == "__init__.py"):
            submodules = {f"{base}.{n}" for n in names} & set(paths)
            if names and len(submodules) == len(names):
                targets |= submodules
            else:
                targets |= {base} | submodules
        graph[name] = {m for m in targets if m in paths and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
