"""Rules between the packages of ``vllm_hybrid``, checked from the source.

Every package counts (each module of the package root, such as ``logger`` or
``plugin``, as a package of its own): no import cycle between packages; the
core (``vllm_hybrid.v1.core``) never imports metrics, tools or the plugin;
the options (``vllm_hybrid.config``) never import pooled mode, which reads
them; the core writes no file and sets no environment variable (it hands
values to the layers above, which carry them). docs/architecture.md has the map
of the packages.

Imports that break a rule would be listed in :data:`ALLOWED` (none today), each
with why it exists and what would remove it; a listed import that no longer
breaks a rule fails the test too, so the list only shrinks. Each test
reports every violation it finds, not only the first.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from import_graph import PACKAGE, cycles, import_graph, module_name

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


#: Every import that breaks a package rule today (none): an entry names why
#: it exists and the change that would remove it; once that change lands the
#: test fails until the entry is deleted.
ALLOWED: tuple[Allowance, ...] = ()


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


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


#: Subpackages that count as part of the package holding them: their modules
#: take their place in its layers, which ``test_layering.py`` orders module
#: by module (the checkpoint policy sits above ``pooled.spec`` and below the
#: pools, inside pooled mode).
NESTED = (f"{POOLED}.policy",)


def package_of(module: str, packages: set[str]) -> str:
    """The package ``module`` counts in for the package rules: itself if it
    is a package, else the package that holds it; a module directly in the
    package root (``logger``, ``envs``, ``plugin``, ``cli``) is a package of
    its own, since those sit at opposite ends of the layers; a module of a
    :data:`NESTED` subpackage counts in the package above it."""
    for nested in NESTED:
        if module == nested or module.startswith(nested + "."):
            return nested.rpartition(".")[0]
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
    return {module_name(p, root) for p in root.rglob("__init__.py")}


def test_no_package_import_cycle(graph):
    assert package_cycles(graph, packages_of(), allowed_imports()) == []


def test_a_nested_subpackage_counts_in_the_package_above_it(graph):
    packages = packages_of()
    for nested in NESTED:
        # a stale entry (no such package) fails here
        assert nested in packages
        parent = nested.rpartition(".")[0]
        modules = [m for m in graph if m.startswith(nested + ".")]
        assert modules
        assert {package_of(m, packages) for m in modules} == {parent}
    # any other package still counts on its own
    assert package_of(f"{CORE}.sched.scheduler", packages) == f"{CORE}.sched"


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


#: Calls that write a file or set the process environment, by their text.
SIDE_EFFECT_CALLS = ("os.replace", "os.rename", "os.putenv", "shutil.", "tempfile.")


def _write(node: ast.AST) -> str | None:
    """The text of ``node`` if it writes a file or the environment."""
    if isinstance(node, ast.Call):
        func = ast.unparse(node.func)
        if func == "open":
            mode = node.args[1] if len(node.args) > 1 else None
            mode = next((k.value for k in node.keywords if k.arg == "mode"), mode)
            read_only = mode is None or (
                isinstance(mode, ast.Constant) and not set(str(mode.value)) - set("rbt")
            )
            return None if read_only else ast.unparse(node)
        environ = ("os.environ.setdefault", "os.environ.update", "os.environ.pop")
        if func.startswith(SIDE_EFFECT_CALLS) or func in environ:
            return ast.unparse(node)
    if isinstance(node, ast.Assign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Subscript)
                and ast.unparse(target.value) == "os.environ"
            ):
                return ast.unparse(target)
    return None


def side_effects(root: Path, package: str) -> list[str]:
    """``module: code`` of every file write (``open`` with a mode that is not
    read-only, the calls of :data:`SIDE_EFFECT_CALLS`) and environment write
    (``os.environ[...] = ...``, ``os.environ.setdefault/update/pop``) in the
    modules of ``package``, in source order."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if not _under(module, package):
            continue
        writes = [
            (node.lineno, text)
            for node in ast.walk(ast.parse(path.read_text()))
            if (text := _write(node)) is not None
        ]
        found += [f"{module}: {text}" for _, text in sorted(writes)]
    return found


def test_the_core_writes_no_file_and_sets_no_environment():
    """Transport (the pools' usage to /metrics) is the metrics side's: the
    core hands values over and leaves files and the environment alone."""
    assert side_effects(PACKAGE, CORE) == []


def test_side_effect_check_names_each_write(tmp_path):
    root = tmp_path / "vllm_hybrid"
    (root / "v1" / "core").mkdir(parents=True)
    (root / "v1" / "core" / "a.py").write_text(
        "import os\n"
        "def f(path):\n"
        "    open(path).read()\n"
        "    open(path, 'rb').read()\n"
        "    open(path, 'w').write('x')\n"
        "    os.replace(path, path + '.old')\n"
        "    os.environ['X'] = '1'\n"
        "    return os.environ.get('X')\n"
    )
    assert side_effects(root, "vllm_hybrid.v1.core") == [
        "vllm_hybrid.v1.core.a: open(path, 'w')",
        "vllm_hybrid.v1.core.a: os.replace(path, path + '.old')",
        "vllm_hybrid.v1.core.a: os.environ['X']",
    ]
