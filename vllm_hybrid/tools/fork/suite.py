"""This repository's tests that go into the fork's ``tests/`` tree.

A test module goes along when everything it imports exists in the fork:
every overlay name it reads has a home there (:mod:`.symbols`), the test
helpers it imports go along too, and the fixtures it takes are not this
repository's tiny-model fixtures (built with the overlay's tools). Each goes
into the commit of the newest fork module it imports, at its own path under
``tests/`` (``_hybrid`` added to the name where vLLM has a test module of
that name), with imports of its sibling helpers written as vLLM's tests
write them (``from tests.v1.core.pooled.test_arena import ...``).
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hybrid.tools.fork.code import ForkError, Origin
from vllm_hybrid.tools.fork.modules import PACKAGE, dotted
from vllm_hybrid.tools.fork.rewrite import Removal, render_module
from vllm_hybrid.tools.fork.source import Edit, Source, apply_edits

#: Test modules (``path``, patterns allowed) and tests (``path::name``) that
#: import what the fork has but test what only the overlay has, and why
#: they stay. Tests that patch the registry's ``upstream_of``, set options
#: through ``--additional-config`` or read a name the fork drops are found
#: without a row.
NOT_FORK_TESTS: dict[str, str] = {
    "kernels/*": (
        "the kernel tier runs upstream's Triton kernels in Triton's interpreter, "
        "in a process of its own this repository's tests/kernels/conftest.py sets up"
    ),
    "ops/test_tq_native.py::test_native_kernel_is_built": (
        "checks that this repository's install built the kernel; in the fork "
        "vLLM's CMake builds it"
    ),
    "v1/core/test_retention.py::"
    "test_only_align_mode_state_groups_beside_attention_keep_turn_ends": (
        "reads KVCacheConfig.retain_turn_ends as absent on configs nothing "
        "marked; the fork declares the field (False)"
    ),
    "v1/worker/test_v2_self_copies.py::"
    "test_the_replacements_take_upstreams_parameters": (
        "compares the registry's replacements with upstream's signatures; the "
        "fork has no replacements"
    ),
}

#: Text in a test that ties it to the overlay's mechanism, and why.
_OVERLAY_ONLY = {
    "upstream_of": "patches the registry's lookup of upstream's object",
    "additional_config": "sets options through --additional-config",
}


@dataclass
class ForkTest:
    """One test module (or helper, or conftest) in the fork."""

    path: str
    fork_path: str
    commit: int
    text: str
    #: Its tests that stay here (name -> why).
    left_out: dict[str, str] = field(default_factory=dict)


@dataclass
class _Module:
    path: str
    source: Source
    imports: set[str]
    siblings: set[str]
    fixtures_used: set[str]
    fixtures_defined: set[str]


def select(
    build, tests_root: Path, upstream_exists
) -> tuple[list[ForkTest], dict[str, str]]:
    """The fork's test modules, and why each other one stays here.
    ``upstream_exists(path)`` says whether vLLM's tree has ``path``."""
    modules = {
        p.relative_to(tests_root).as_posix(): _scan(tests_root, p)
        for p in sorted(tests_root.rglob("*.py"))
    }
    by_name = _importable_names(modules)
    skipped: dict[str, str] = {
        path: why
        for path in modules
        for pattern, why in NOT_FORK_TESTS.items()
        if "::" not in pattern and fnmatch.fnmatchcase(path, pattern)
    }
    commits: dict[str, int] = {}
    own_commit = {m.name: i for i, m in _commit_indices(build)}
    fixtures_of_skipped: set[str] = set()
    changed = True
    while changed:
        changed = False
        for path, module in modules.items():
            if path in skipped or path in commits:
                continue
            why, commit = _judge(
                module, modules, by_name, build, own_commit, skipped, commits
            )
            missing = module.fixtures_used & fixtures_of_skipped
            if why is None and missing:
                why = f"takes fixtures {sorted(missing)}"
            if why is not None:
                skipped[path] = why
                if path.endswith("conftest.py"):
                    fixtures_of_skipped |= module.fixtures_defined
                changed = True
            elif commit is not None:
                commits[path] = commit
                changed = True
    for path in modules:
        if path not in skipped and path not in commits:
            skipped[path] = "imports test helpers that import it back"
    found = []
    for path, commit in sorted(commits.items()):
        fork_path = f"tests/{path}"
        if upstream_exists(fork_path):
            if path.endswith("conftest.py"):
                skipped[path] = "vLLM has a conftest.py there"
                continue
            fork_path = fork_path.removesuffix(".py") + "_hybrid.py"
        found.append(ForkTest(path, fork_path, commit, ""))
    homes = {
        _module_key(t.path): _module_key(t.fork_path.removeprefix("tests/"))
        for t in found
    }
    for test in found:
        try:
            test.text = _render(build, modules[test.path], test, homes, by_name)
        except ForkError as exc:
            skipped[test.path] = str(exc)
    found = [t for t in found if t.text]
    return found, skipped


def _commit_indices(build):
    from vllm_hybrid.tools.fork.plan import commit_index

    return [
        (commit_index(m.commit.key), m) for m in build.modules if m.commit is not None
    ]


def _module_key(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _scan(root: Path, path: Path) -> _Module:
    source = Source(path.read_text(), path.as_posix())
    imports, siblings = set(), set()
    used, defined = set(), set()
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                # ">" marks an import inside a function
                mark = ">" if node.col_offset else ":"
                imports.add(f"{node.module}{mark}{alias.name}")
            siblings.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imports.add(f"{alias.name}:")
                siblings.add(alias.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = {a.arg for a in node.args.args}
            if node.name.startswith("test") or _is_fixture(node):
                used |= params
            if _is_fixture(node):
                defined.add(node.name)
    return _Module(
        path.relative_to(root).as_posix(), source, imports, siblings, used, defined
    )


def _is_fixture(node) -> bool:
    return any("fixture" in ast.unparse(d) for d in node.decorator_list)


def _importable_names(modules: dict[str, _Module]) -> dict[str, dict[str, str]]:
    """Per test directory, the bare module names its tests import from
    their own directory or from ``tests/`` itself -> their paths."""
    names: dict[str, dict[str, str]] = {}
    for path in modules:
        directory = str(Path(path).parent)
        stem = Path(path).stem
        names.setdefault(directory, {})[stem] = path
    return names


def _sibling(path: str, name: str, by_name: dict[str, dict[str, str]]) -> str | None:
    directory = str(Path(path).parent)
    return by_name.get(directory, {}).get(name) or by_name.get(".", {}).get(name)


def _judge(module, modules, by_name, build, own_commit, skipped, commits):
    """(why it stays, or None; its commit once known)."""
    commit = -1
    for imported in sorted(module.imports):
        nested = ">" in imported
        name, _, attr = imported.replace(">", ":").partition(":")
        top = name.split(".")[0]
        if top == PACKAGE:
            home = build.table.home(name, attr or None)
            if home is None and nested and (name, attr) in build.table.methods:
                home = name  # bound to the method inside the function
            if home is None:
                return (
                    f"imports {name}.{attr}: {build.table.why_dropped(name, attr)}",
                    None,
                )
            owner = name if f"{name}.{attr}" not in own_commit else f"{name}.{attr}"
            while owner not in own_commit and "." in owner:
                owner = owner.rsplit(".", 1)[0]
            commit = max(commit, own_commit.get(owner, 0))
            continue
        sibling = _sibling(module.path, top, by_name)
        if sibling is not None and sibling != module.path:
            if sibling in skipped:
                return f"imports the test helper {sibling}, which stays", None
            if sibling not in commits:
                return None, None  # decided once the helper is
            commit = max(commit, commits[sibling])
        elif top in ("sitecustomize", "suite_order", "import_graph"):
            return f"imports {top}, a helper of this repository's suite", None
        elif top != "tests" and (
            (build.repo_root / top).is_dir()
            or (build.repo_root / f"{top}.py").is_file()
        ):
            return f"imports {top}, this repository's own (not vLLM's)", None
    if commit < 0:
        return "imports none of the fork's modules", None
    return None, commit


def overlay_only_tests(build, module: _Module) -> dict[str, str]:
    """Top-level tests of ``module`` that test what only the overlay has."""
    found = {}
    src = module.source
    modules = _overlay_module_aliases(build, src)
    for stmt in src.tree.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            continue
        if not stmt.name.lower().startswith("test"):
            continue
        row = NOT_FORK_TESTS.get(f"{module.path}::{stmt.name}")
        text = src.segment(stmt)
        why = row or next((w for key, w in _OVERLAY_ONLY.items() if key in text), None)
        if why is None:
            for node in ast.walk(stmt):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in modules
                    and build.table.home(modules[node.value.id], node.attr) is None
                ):
                    why = f"reads {node.value.id}.{node.attr}, which the fork has not"
                    break
        if why is not None:
            found[stmt.name] = why
    return found


def _overlay_module_aliases(build, src: Source) -> dict[str, str]:
    """Names a test module binds to overlay modules -> the module."""
    found = {}
    for stmt in src.tree.body:
        if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith(PACKAGE):
            for alias in stmt.names:
                name = f"{stmt.module}.{alias.name}"
                if name in build.table.modules:
                    found[alias.asname or alias.name] = name
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name.startswith(PACKAGE) and alias.asname:
                    found[alias.asname] = alias.name
    return found


def _render(build, module: _Module, test: ForkTest, homes, by_name) -> str:
    origin = Origin(_module_key(test.path), module.source)
    test.left_out = overlay_only_tests(build, module)
    removal = Removal(
        statements={
            id(s)
            for s in module.source.tree.body
            if isinstance(s, (ast.FunctionDef, ast.ClassDef))
            and s.name in test.left_out
        }
    )
    text = render_module(
        origin, _module_key(test.fork_path), build.table, removal, {}, {}
    )
    source = Source(text)
    edits = []
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            sibling = _sibling(module.path, node.module.split(".")[0], by_name)
            if sibling is None:
                continue
            home = homes.get(_module_key(sibling))
            if home is None:
                raise ForkError(f"{test.path}: helper {sibling} is not in the fork")
            a, b = source.span(node)
            names = ", ".join(
                a_.name + (f" as {a_.asname}" if a_.asname else "") for a_ in node.names
            )
            edits.append(Edit(a, b, f"from tests.{home} import {names}"))
    return build.text(apply_edits(text, edits))


def package_inits(tests: list[ForkTest], upstream_exists) -> dict[str, str]:
    """Empty ``__init__.py`` for each new test directory (vLLM's tests are a
    package)."""
    found = {}
    for test in tests:
        parts = Path(test.fork_path).parent.parts
        for i in range(1, len(parts) + 1):
            init = "/".join([*parts[:i], "__init__.py"])
            if not upstream_exists(init):
                found[init] = ""
    return found


__all__ = ["ForkTest", "dotted", "package_inits", "select"]
