"""The package's structure, checked from the source: import graph and sizes.

Rules (docs/overlay.md has the map): no import cycles between modules, and
none between packages either (every package of ``vllm_hybrid``, each module of
the package root counting as a package of its own); the core
(``vllm_hybrid.v1.core``) never imports metrics, tools or the plugin; the
options (``vllm_hybrid.config``) never import pooled mode; inside
``vllm_hybrid.v1.core.pooled`` a module imports only from the layers below
it, and does not reach a higher layer through an object it was handed (a
call or attribute only a higher module defines) nor call another pooled
class's private method; no module is over 500 lines.

The few package imports that break a rule today are listed in
:data:`ALLOWED`, each with why it exists and what would remove it; a listed
import that no longer breaks a rule fails the test too, so the list only
shrinks. Each test reports every violation it finds, not only the first.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_hybrid"
MAX_LINES = 500

#: Bottom to top; a pooled module may import only modules listed before it.
POOLED_LAYERS = (
    "spec",
    "layers",
    "prefill_checkpoints",
    "usage",
    "links",
    "eviction",
    "free_queue",
    "block_pool",
    "coupling",
    "boundary",
    "arena",
    "planner",
    "scope",
    "coordinator",
    "engine",
)
ROOT = "vllm_hybrid"
CORE = f"{ROOT}.v1.core"
POOLED = f"{CORE}.pooled"
#: ``(importer, imported)``: no module under the first prefix imports one
#: under the second.
FORBIDDEN = (
    (CORE, f"{ROOT}.v1.metrics"),
    (CORE, f"{ROOT}.tools"),
    (CORE, f"{ROOT}.plugin"),
    (f"{ROOT}.config", POOLED),
)


@dataclass(frozen=True)
class Allowance:
    """Module imports that break a package rule today, kept on purpose."""

    #: ``(module, imported module)``, both without the ``vllm_hybrid.`` prefix.
    imports: tuple[tuple[str, str], ...]
    why: str
    removed_by: str


#: Every import that breaks a package rule today. The modules involved are
#: being changed elsewhere; the entries go when the change in ``removed_by``
#: lands (the test then fails until the entry is deleted).
ALLOWED = (
    Allowance(
        imports=(("v1.core.pooled.coordinator", "v1.core.retention"),),
        why="the pooled coordinators keep turn-end checkpoints with the mixin "
        "of v1/core/retention.py, which itself ranks checkpoints with "
        "pooled/eviction and places them with pooled/prefill_checkpoints: a "
        "cycle between v1/core and v1/core/pooled",
        removed_by="moving retention.py into pooled/ (a layer below "
        "coordinator), or eviction ranking and checkpoint positions out of "
        "pooled/",
    ),
    Allowance(
        imports=(
            ("v1.core.pooled.engine", "v1.core.sched.scheduler"),
            ("v1.core.pooled.engine", "v1.core.sched.async_scheduler"),
        ),
        why="pooled/engine picks the scheduler class (select_scheduler), "
        "while the pooled schedulers read the arena through "
        "pooled/coordinator: a cycle between v1/core/pooled and v1/core/sched",
        removed_by="moving select_scheduler up into v1/core/kv_cache_utils, "
        "its only caller, so the scheduler sits above pooled mode",
    ),
    Allowance(
        imports=(
            ("config.cudagraph_capacity", "v1.core.pooled.planner"),
            ("config.cudagraph_capacity", "v1.core.pooled.spec"),
        ),
        why="CUDA-graph sizing reads a pooled plan (state blocks per request, "
        "the pooled config class) while pooled mode reads its options from "
        "config/hybrid_kv: config/ imports pooled mode, and the two packages "
        "form a cycle",
        removed_by="computing capacity in one module below config/ that both "
        "read, or moving CUDA-graph sizing out of config/ to the engine glue",
    ),
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


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def allowed_imports(allowed: tuple[Allowance, ...] = ALLOWED) -> set[tuple[str, str]]:
    return {(f"{ROOT}.{a}", f"{ROOT}.{b}") for x in allowed for a, b in x.imports}


def forbidden_imports(
    graph: dict[str, set[str]], rules: tuple[tuple[str, str], ...] = FORBIDDEN
) -> list[str]:
    """One line per import ``rules`` forbid: ``module -> imported``."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        for importer, imported in rules
        if _under(module, importer) and _under(target, imported)
    )


def test_forbidden_imports_are_only_the_allowed_ones(graph):
    """The core imports no metrics, tools or plugin; config/ imports no
    pooled module (it is read by pooled mode)."""
    allowed = {f"{a} -> {b}" for a, b in allowed_imports()}
    assert [line for line in forbidden_imports(graph) if line not in allowed] == []


def package_of(module: str, packages: set[str]) -> str:
    """The package ``module`` counts in for the package rules: itself if it
    is a package, else the package that holds it; a module directly in the
    package root (``logger``, ``envs``, ``plugin``, ``cli``) is a package of
    its own, since those sit at opposite ends of the layers."""
    if module in packages:
        return module
    parent = module.rpartition(".")[0]
    return module if parent == ROOT else parent


def package_graph(
    graph: dict[str, set[str]], packages: set[str], skip: set[tuple[str, str]]
) -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the module imports (``a -> b``) that
    make the edge, leaving out the ``skip`` imports."""
    edges: dict[str, dict[str, list[str]]] = {}
    for module, targets in graph.items():
        here = package_of(module, packages)
        edges.setdefault(here, {})
        for target in sorted(targets):
            there = package_of(target, packages)
            if there != here and (module, target) not in skip:
                edges[here].setdefault(there, []).append(f"{module} -> {target}")
    return edges


def package_cycles(
    graph: dict[str, set[str]],
    packages: set[str],
    skip: set[tuple[str, str]] = frozenset(),
) -> list[str]:
    """One line per package import inside a package cycle, with the module
    imports behind it: every import a fix has to choose from."""
    edges = package_graph(graph, packages, skip)
    lines = []
    for component in cycles({p: set(t) for p, t in edges.items()}):
        for here in component:
            for there in component:
                if there in edges[here]:
                    imports = ", ".join(edges[here][there])
                    lines.append(f"{here} => {there} ({imports})")
    return lines


def packages_of(root: Path = PACKAGE) -> set[str]:
    return {_module_name(p, root) for p in root.rglob("__init__.py")}


def test_no_package_import_cycle(graph):
    assert package_cycles(graph, packages_of(), allowed_imports()) == []


def test_each_allowed_import_still_breaks_a_rule(graph):
    """An allowance whose imports are gone, or no longer close a cycle nor
    break a forbidden import, is stale: delete it."""
    packages = packages_of()
    for allowance in ALLOWED:
        mine = allowed_imports((allowance,))
        assert all(b in graph[a] for a, b in mine), allowance.imports
        others = allowed_imports() - mine
        breaks = set(package_cycles(graph, packages, others)) - set(
            package_cycles(graph, packages, allowed_imports())
        )
        forbidden = {f"{a} -> {b}" for a, b in mine} & set(forbidden_imports(graph))
        assert breaks or forbidden, allowance.imports


def test_package_check_reports_a_planted_cycle(tmp_path):
    """A cycle between two packages that no two modules close: ``low.a``
    imports ``high.b``, ``high.c`` imports ``low.d``; the module graph has no
    cycle, the package graph reports both imports, and allowing one of them
    clears it."""
    root = tmp_path / "vllm_hybrid"
    for package in ("low", "high"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("from vllm_hybrid.high import b\n")
    (root / "high" / "b.py").write_text("")
    (root / "high" / "c.py").write_text("from vllm_hybrid.low import d\n")
    (root / "low" / "d.py").write_text("")
    (root / "logger.py").write_text("")
    (root / "plugin.py").write_text("import vllm_hybrid.logger\n")
    graph = import_graph(root)
    packages = packages_of(root)
    assert cycles(graph) == []
    assert package_cycles(graph, packages) == [
        "vllm_hybrid.high => vllm_hybrid.low (vllm_hybrid.high.c -> vllm_hybrid.low.d)",
        "vllm_hybrid.low => vllm_hybrid.high (vllm_hybrid.low.a -> vllm_hybrid.high.b)",
    ]
    skip = {("vllm_hybrid.low.a", "vllm_hybrid.high.b")}
    assert package_cycles(graph, packages, skip) == []
    # root modules are packages of their own: plugin -> logger is no cycle
    assert package_of("vllm_hybrid.plugin", packages) == "vllm_hybrid.plugin"
    assert package_of("vllm_hybrid.low.a", packages) == "vllm_hybrid.low"
    assert package_of("vllm_hybrid.low", packages) == "vllm_hybrid.low"


def test_forbidden_import_check_names_each_import():
    graph = {
        "vllm_hybrid.config.a": {"vllm_hybrid.v1.core.pooled.spec"},
        "vllm_hybrid.config.b": {"vllm_hybrid.envs"},
        "vllm_hybrid.v1.core.x": {"vllm_hybrid.tools.plan", "vllm_hybrid.plugin"},
        "vllm_hybrid.v1.corex": {"vllm_hybrid.plugin"},
    }
    assert forbidden_imports(graph) == [
        "vllm_hybrid.config.a -> vllm_hybrid.v1.core.pooled.spec",
        "vllm_hybrid.v1.core.x -> vllm_hybrid.plugin",
        "vllm_hybrid.v1.core.x -> vllm_hybrid.tools.plan",
    ]


def test_pooled_modules_import_only_lower_layers(graph):
    prefix = f"{POOLED}."
    modules = {m.removeprefix(prefix) for m in graph if m.startswith(prefix)}
    assert modules == set(POOLED_LAYERS)
    upward = [
        f"{name} imports {target}, which is not below it"
        for layer, name in enumerate(POOLED_LAYERS)
        for target in sorted(graph[prefix + name])
        if target.startswith(prefix)
        and POOLED_LAYERS.index(target.removeprefix(prefix)) >= layer
    ]
    assert upward == []


def test_the_config_pickled_to_workers_imports_no_pool(graph):
    spec = graph[f"{POOLED}.spec"]
    assert spec <= {"vllm_hybrid", "vllm_hybrid.logger"}


def defined_names(tree: ast.Module) -> set[str]:
    """Methods and attributes the classes of a module define (``self.x = ``
    included), dunders left out."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return {n for n in names if not n.startswith("__")}


def _foreign_attributes(tree: ast.Module) -> list[tuple[str, bool]]:
    """``(name, called)`` of every attribute read or call on an object other
    than ``self``, ``cls`` or ``super()``."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
            continue
        found.append((node.attr, id(node) in called))
    return found


#: vLLM modules whose classes the pooled layer subclasses or is handed; the
#: names they define are upstream's interface, not a pooled module's.
UPSTREAM_INTERFACES = (
    "v1/core/block_pool.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/kv_cache_manager.py",
    "v1/core/kv_cache_utils.py",
    "v1/core/sched/scheduler.py",
    "v1/core/single_type_kv_cache_manager.py",
    "v1/kv_cache_interface.py",
    "v1/request.py",
)


def ambient_names() -> set[str]:
    """Attribute names of builtin containers and of upstream's interfaces."""
    import vllm

    names = {n for kind in (list, dict, set, str, tuple) for n in dir(kind)}
    base = Path(vllm.__file__).parent
    for rel in UPSTREAM_INTERFACES:
        names |= defined_names(ast.parse((base / rel).read_text()))
    return names


def attribute_graph(
    root: Path, package: str, ambient: frozenset[str] = frozenset()
) -> dict[str, set[str]]:
    """module -> modules of ``package`` it reaches through objects: it uses
    an attribute of another object that only modules of ``package`` define,
    and not ``ambient`` (the lowest of them by import order counts: an
    interface there)."""
    paths = {
        _module_name(p, root): p
        for p in root.rglob("*.py")
        if _module_name(p, root).startswith(package + ".")
    }
    trees = {name: ast.parse(path.read_text()) for name, path in paths.items()}
    definers: dict[str, list[str]] = {}
    for name, tree in trees.items():
        for attr in defined_names(tree) - ambient:
            definers.setdefault(attr, []).append(name)
    order = {name: i for i, name in enumerate(_import_order(trees, root))}
    graph = {}
    for name, tree in trees.items():
        reached = set()
        for attr, _ in _foreign_attributes(tree):
            if attr in definers:
                reached.add(min(definers[attr], key=order.__getitem__))
        graph[name] = reached - {name}
    return graph


def _import_order(trees: dict[str, ast.Module], root: Path) -> list[str]:
    """Modules with every module they import before them (ties by name)."""
    graph = import_graph(root)
    done: list[str] = []
    seen: set[str] = set()

    def visit(module: str) -> None:
        if module in seen:
            return
        seen.add(module)
        for target in sorted(graph.get(module, ())):
            if target in trees:
                visit(target)
        done.append(module)

    for module in sorted(trees):
        visit(module)
    return done


def private_calls(root: Path, package: str) -> list[tuple[str, str]]:
    """``(module, method)`` of calls into a private method that a class of
    ``package`` defines, made on an object other than ``self``/``super()``."""
    modules = [
        (name, path)
        for path in root.rglob("*.py")
        if (name := _module_name(path, root)).startswith(package + ".")
    ]
    trees = {name: ast.parse(path.read_text()) for name, path in modules}
    private = {n for tree in trees.values() for n in defined_names(tree)}
    private = {n for n in private if n.startswith("_")}
    return sorted(
        (name, attr)
        for name, tree in trees.items()
        for attr, called in _foreign_attributes(tree)
        if called and attr in private
    )


@pytest.fixture(scope="module")
def pooled_reach() -> dict[str, set[str]]:
    return attribute_graph(PACKAGE, POOLED, frozenset(ambient_names()))


def test_pooled_modules_reach_no_higher_layer_through_objects(pooled_reach):
    prefix = f"{POOLED}."
    upward = [
        f"{name} reaches {target} through an object it holds"
        for layer, name in enumerate(POOLED_LAYERS)
        for target in sorted(pooled_reach.get(prefix + name, ()))
        if POOLED_LAYERS.index(target.removeprefix(prefix)) > layer
    ]
    assert upward == []


def test_no_pooled_class_calls_another_ones_private_method():
    assert private_calls(PACKAGE, POOLED) == []


def test_reach_check_sees_a_callback_into_a_higher_module(tmp_path):
    """A pool that holds its arena untyped and calls back into it: the import
    graph sees only ``arena -> pool``, the attribute graph sees the way back,
    and the private call."""
    pkg = tmp_path / "vllm_hybrid" / "pooled"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm_hybrid" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "pool.py").write_text(
        "class Pool:\n"
        "    def __init__(self, arena):\n"
        "        self.arena = arena\n"
        "    def take(self):\n"
        "        self.arena.make_room(1)\n"
        "    def _give_away(self):\n"
        "        pass\n"
    )
    (pkg / "arena.py").write_text(
        "from vllm_hybrid.pooled.pool import Pool\n"
        "class Arena:\n"
        "    def __init__(self):\n"
        "        self.pool = Pool(self)\n"
        "    def make_room(self, n):\n"
        "        self.pool._give_away()\n"
    )
    root = tmp_path / "vllm_hybrid"
    assert import_graph(root)["vllm_hybrid.pooled.pool"] == set()
    reach = attribute_graph(root, "vllm_hybrid.pooled")
    assert reach["vllm_hybrid.pooled.pool"] == {"vllm_hybrid.pooled.arena"}
    assert reach["vllm_hybrid.pooled.arena"] == {"vllm_hybrid.pooled.pool"}
    assert private_calls(root, "vllm_hybrid.pooled") == [
        ("vllm_hybrid.pooled.arena", "_give_away")
    ]


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
