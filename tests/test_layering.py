"""The package's structure, checked from the source: import graph and sizes.

Rules (docs/architecture.md has the map): no import cycle between modules (the
rules between packages are in ``test_package_layers.py``); inside
``vllm_hybrid.v1.core.pooled`` a module imports only from the layers below
it, and does not reach a higher layer through an object it was handed (a
call or attribute only a higher module defines) nor call another pooled
class's private method; no module is over 500 lines. Each test reports every
violation it finds, not only the first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from import_graph import PACKAGE, cycles, import_graph, module_name

#: The length past which a module is looked at again in review: one
#: responsibility may need more, said in :data:`LONG_MODULES`; the length
#: alone never decides a split.
MAX_LINES = 500
#: Modules past :data:`MAX_LINES`, each with the one thing it does.
LONG_MODULES: dict[str, str] = {}

#: Bottom to top; a pooled module may import only modules listed before it.
POOLED_LAYERS = (
    "spec",
    "layers",
    "usage",
    "links",
    "policy.eviction",
    "policy.positions",
    "policy.steps",
    "policy",
    "free_queue",
    "events",
    "block_pool",
    "coupling",
    "moves",
    "boundary",
    "arena",
    "admission",
    "capacity",
    "planner",
    "scope",
    "retention",
    "coordinator",
    "engine",
)
CORE = "vllm_hybrid.v1.core"
POOLED = f"{CORE}.pooled"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_package_has_no_import_cycle(graph):
    assert cycles(graph) == []


def test_cycle_finder_reports_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
        module_name(p, root): p
        for p in root.rglob("*.py")
        if module_name(p, root).startswith(package + ".")
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
        if (name := module_name(path, root)).startswith(package + ".")
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
    """A review threshold: a module past it is listed with its one
    responsibility, and a listed one that shrank below it leaves the list."""
    name = str(path.relative_to(PACKAGE))
    lines = len(path.read_text().splitlines())
    if name in LONG_MODULES:
        assert lines > MAX_LINES, f"{name} has {lines} lines: unlist it"
    else:
        assert lines <= MAX_LINES, (
            f"{name} has {lines} lines: split it by meaning, or list it in "
            "LONG_MODULES with the one thing it does"
        )
