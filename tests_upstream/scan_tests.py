"""Find the tests of vLLM's ``tests/`` tree that touch a patched symbol.

A test function touches a registry target (``module:attr`` or
``module:Class.attr``) when

* its file imports the target's home module, or imports from that module
  (or from a package above it, which re-exports) the symbol, or, for a
  method, its class or a subclass of it (``from vllm.config import
  CompilationConfig``, ``from vllm import AsyncEngineArgs``); and
* the test refers to the symbol's name (``f(...)``, ``obj.f(...)``,
  ``mock.patch("...f")``), directly or through helpers and fixtures of its
  file, or fixtures of a ``conftest.py`` above it, that do (followed by name
  to a fixed point).

Names are matched, not resolved: a test reached only through an object
whose class its file never names is missed, and a same-named method of an
unrelated class is taken when the file also imports the patched class.
Used by ``select_tests.py``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    """A registry target ``module:attr`` or ``module:Class.attr``."""

    target: str
    module: str
    owner: str | None
    name: str

    @classmethod
    def parse(cls, target: str) -> Target:
        module, attr_path = target.split(":", 1)
        *owners, name = attr_path.split(".")
        return cls(target, module, owners[-1] if owners else None, name)


# ---------------------------------------------------------------------------
# Subclasses of the patched classes, from the installed vLLM
# ---------------------------------------------------------------------------


#: A class statement and its bases: ``class Name(Base, pkg.Other[T], ...)``.
_CLASS = re.compile(r"^[ \t]*class[ \t]+(\w+)[ \t]*\(([^)]*)\)", re.M)


def _bases(text: str) -> list[str]:
    """The base-class names in a class statement's parentheses (the last
    dotted part, generic arguments and keywords such as ``metaclass=``
    dropped)."""
    names = []
    depth = 0
    part = ""
    for ch in text + ",":
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            part = part.split("[", 1)[0].strip()
            if part and "=" not in part:
                names.append(part.rsplit(".", 1)[-1])
            part = ""
        else:
            part += ch
    return names


class ClassIndex:
    """The classes of a package and their base-class names, read from the
    class statements (a regular expression; parsing every module of vLLM
    took half a minute on 2 cores)."""

    def __init__(self, package_root: Path) -> None:
        self.classes: list[tuple[str, set[str]]] = []
        for path in sorted(package_root.rglob("*.py")):
            text = path.read_text(errors="replace")
            self.classes += [
                (m.group(1), set(_bases(m.group(2)))) for m in _CLASS.finditer(text)
            ]

    def subclass_names(self, owner: str) -> set[str]:
        """``owner`` and the names of the classes that derive from it (by
        base-class name, transitively)."""
        names = {owner}
        while True:
            new = {name for name, bases in self.classes if bases & names} - names
            if not new:
                return names
            names |= new


# ---------------------------------------------------------------------------
# One file
# ---------------------------------------------------------------------------


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


_Func = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Func:
    """A module-level function or a method of a module-level class, with
    every name it refers to."""

    cls: str | None
    name: str
    #: Names, attribute names and argument names anywhere in its body.
    refs: frozenset[str]
    #: The last dotted part of each string constant ("pkg.mod.f" -> "f").
    tails: frozenset[str]
    fixture: bool

    @classmethod
    def of(cls, owner: str | None, node: _Func) -> Func:
        refs, tails = set(), set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                refs.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                refs.add(sub.attr)
            elif isinstance(sub, ast.arg):
                refs.add(sub.arg)
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                tails.add(re.split(r"[.:]", sub.value)[-1])
        fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
        return cls(owner, node.name, frozenset(refs), frozenset(tails), fixture)

    @property
    def is_test(self) -> bool:
        return self.name.startswith("test") and (
            self.cls is None or self.cls.startswith("Test")
        )

    def node_id(self, rel: str) -> str:
        return f"{rel}::{self.cls}::{self.name}" if self.cls else f"{rel}::{self.name}"


class SourceFile:
    """What the scan needs of one test file or conftest: its imports and
    its functions."""

    def __init__(self, tree: ast.Module) -> None:
        #: ``(module, None)`` for ``import module``; ``(module, name)`` for
        #: ``from module import name`` (absolute imports, anywhere).
        self.imports: list[tuple[str, str | None]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.imports += [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                self.imports += [(node.module, a.name) for a in node.names]
        self.funcs: list[Func] = []
        for node in tree.body:
            if isinstance(node, _Func):
                self.funcs.append(Func.of(None, node))
            elif isinstance(node, ast.ClassDef):
                self.funcs += [
                    Func.of(node.name, sub)
                    for sub in node.body
                    if isinstance(sub, _Func)
                ]

    def imports_target(self, t: Target, owners: set[str]) -> bool:
        """Whether the file imports ``t``'s module, or its symbol or class
        (``owners``: the class and its subclasses) from that module or a
        package above it, which re-exports it."""
        names = owners if t.owner else {t.name}
        parents = _parents(t.module)
        for module, name in self.imports:
            if name is None:
                if module == t.module or module.startswith(t.module + "."):
                    return True
            elif module == t.module or (
                module in parents and (name in names or f"{module}.{name}" == t.module)
            ):
                return True
        return False

    def touching(
        self, symbol: str | None, inherited: set[str] = frozenset()
    ) -> set[str]:
        """Names of the file's functions that refer to ``symbol``, or to
        another such function, or to a fixture in ``inherited`` (to a fixed
        point). ``symbol`` None: through ``inherited`` only."""
        found = {
            f.name
            for f in self.funcs
            if symbol and (symbol in f.refs or symbol in f.tails)
        }
        while True:
            known = found | set(inherited)
            new = {
                f.name
                for f in self.funcs
                if f.name not in found and (f.refs - {f.name}) & known
            }
            if not new:
                return found
            found |= new

    def selected(self, rel: str, symbol: str | None, inherited: set[str]) -> list[str]:
        """Node ids of the file's tests that touch ``symbol`` (None: only
        through the fixtures ``inherited`` from conftests)."""
        names = self.touching(symbol, inherited)
        return [f.node_id(rel) for f in self.funcs if f.is_test and f.name in names]


# ---------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------


class TestTree:
    """vLLM's ``tests/`` directory: test files and conftests, read once and
    parsed when a target's name (or a fixture that touches it) occurs in
    them; a file that mentions neither cannot touch the target."""

    def __init__(self, src: Path) -> None:
        self.texts = {
            path.relative_to(src).as_posix(): path.read_text(errors="replace")
            for path in sorted((src / "tests").rglob("*.py"))
            if path.name.startswith("test_") or path.name == "conftest.py"
        }
        self._parsed: dict[str, SourceFile | None] = {}

    def source(self, rel: str) -> SourceFile | None:
        if rel not in self._parsed:
            try:
                tree = ast.parse(self.texts[rel], filename=rel)
            except SyntaxError:
                self._parsed[rel] = None
            else:
                self._parsed[rel] = SourceFile(tree)
        return self._parsed[rel]

    def conftest_fixtures(self, t: Target, owners: set[str]) -> dict[str, set[str]]:
        """Directory -> fixtures of its conftest.py that touch ``t``."""
        out = {}
        for rel, text in self.texts.items():
            if not rel.endswith("/conftest.py") or t.name not in text:
                continue
            source = self.source(rel)
            if source is None or not source.imports_target(t, owners):
                continue
            fixtures = {f.name for f in source.funcs if f.fixture}
            fixtures &= source.touching(t.name)
            if fixtures:
                out[rel.rsplit("/", 1)[0]] = fixtures
        return out

    def selected(self, t: Target, owners: set[str]) -> list[str]:
        """Node ids of the tests that touch ``t``."""
        fixtures = self.conftest_fixtures(t, owners)
        # A method is reached through its class or its module, so a file
        # that names neither cannot import it.
        hints = owners | {t.module.rsplit(".", 1)[-1]} if t.owner else {t.name}
        nodes: list[str] = []
        for rel, text in self.texts.items():
            if rel.endswith("/conftest.py"):
                continue
            inherited = {
                name
                for d, names in fixtures.items()
                if rel.startswith(d + "/")
                for name in names
                if name in text
            }
            direct = t.name in text and any(h in text for h in hints)
            if not (direct or inherited):
                continue
            source = self.source(rel)
            if source is None:
                continue
            symbol = t.name if direct and source.imports_target(t, owners) else None
            if symbol or inherited:
                nodes += source.selected(rel, symbol, inherited)
        return sorted(nodes)


def scan(
    src: Path, targets: Iterable[str], vllm_root: Path | None = None
) -> dict[str, list[str]]:
    """Registry target -> node ids of vLLM's tests that touch it.
    ``vllm_root``: the installed vLLM package, where subclasses of patched
    classes are looked up (None: the class itself only)."""
    parsed = [Target.parse(t) for t in targets]
    classes = ClassIndex(vllm_root) if vllm_root else None
    tree = TestTree(src)
    result = {}
    for t in parsed:
        owners: set[str] = set()
        if t.owner:
            owners = classes.subclass_names(t.owner) if classes else {t.owner}
        result[t.target] = tree.selected(t, owners)
    return result
