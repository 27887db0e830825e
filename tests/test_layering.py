"""The package's structure, checked from the source: import graph and sizes.

Rules (docs/overlay.md has the map): no import cycles; the core
(``vllm_hybrid.v1.core``) never imports metrics, tools or the plugin; inside
``vllm_hybrid.v1.core.pooled`` a module imports only from the layers below
it; no module is over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_hybrid"
MAX_LINES = 500

#: Bottom to top; a pooled module may import only modules listed before it.
POOLED_LAYERS = (
    "spec",
    "layers",
    "usage",
    "links",
    "free_queue",
    "block_pool",
    "coupling",
    "arena",
    "planner",
    "scope",
    "coordinator",
    "engine",
)
CORE = "vllm_hybrid.v1.core"
FORBIDDEN_FROM_CORE = (
    "vllm_hybrid.v1.metrics",
    "vllm_hybrid.tools",
    "vllm_hybrid.plugin",
)


def _module_name(path: Path, root: Path) -> str:
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
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
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


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_package_has_no_import_cycle(graph):
    assert cycles(graph) == []


def test_cycle_finder_reports_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_imports_no_metrics_tools_or_plugin(graph):
    bad = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith(CORE)
        for target in targets
        if target.startswith(FORBIDDEN_FROM_CORE)
    }
    assert bad == set()


def test_pooled_modules_import_only_lower_layers(graph):
    prefix = f"{CORE}.pooled."
    modules = {m.removeprefix(prefix) for m in graph if m.startswith(prefix)}
    assert modules == set(POOLED_LAYERS)
    for layer, name in enumerate(POOLED_LAYERS):
        for target in graph[prefix + name]:
            if target.startswith(prefix):
                below = POOLED_LAYERS.index(target.removeprefix(prefix)) < layer
                assert below, f"{name} imports {target}, which is not below it"


def test_the_config_pickled_to_workers_imports_no_pool(graph):
    spec = graph[f"{CORE}.pooled.spec"]
    assert spec <= {"vllm_hybrid", "vllm_hybrid.logger"}


def test_layer_check_reads_relative_and_local_imports(tmp_path):
    pkg = tmp_path / "vllm_hybrid"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from .b import x\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from vllm_hybrid.sub import a\n"
    )
    graph = import_graph(pkg)
    assert graph["vllm_hybrid.sub.a"] == {"vllm_hybrid.sub.b"}
    assert graph["vllm_hybrid.sub"] == {"vllm_hybrid.sub.b"}
    assert graph["vllm_hybrid.sub.b"] == set()


@pytest.mark.parametrize(
    "path",
    sorted(PACKAGE.rglob("*.py")),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_module_is_over_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines"
