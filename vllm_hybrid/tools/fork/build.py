"""The fork's files after each commit, computed from this repository.

:class:`ForkBuild` reads the overlay (its modules, the registry, the commit
plan) once and answers, for the first ``n`` commits, every file of vLLM's
tree that differs from vLLM's and its text. Each commit is the difference
between two such answers, so every state of the series is produced by the
same code and a fix never edits another fix's output.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hybrid.patches.capacity_entries import ADDED_SYMBOLS
from vllm_hybrid.patches.entries import PATCHES
from vllm_hybrid.patches.entry import PatchEntry
from vllm_hybrid.patches.subclasses import ADDED_ATTRIBUTES
from vllm_hybrid.tools.fork import wiring
from vllm_hybrid.tools.fork.code import ForkError, Origin
from vllm_hybrid.tools.fork.modules import PACKAGE, OverlayModule, overlay_modules
from vllm_hybrid.tools.fork.options import CONFIG_CLASS, variable_rows
from vllm_hybrid.tools.fork.placement import Placed, place
from vllm_hybrid.tools.fork.plan import COMMITS, commit_index
from vllm_hybrid.tools.fork.rewrite import (
    merge_definitions,
    plan_removal,
    render_module,
)
from vllm_hybrid.tools.fork.shapes import Replacement, find_replacement
from vllm_hybrid.tools.fork.source import Source, bound_names, loaded_names
from vllm_hybrid.tools.fork.suite import package_inits
from vllm_hybrid.tools.fork.suite import select as select_tests
from vllm_hybrid.tools.fork.symbols import Home, SymbolTable
from vllm_hybrid.tools.fork.text import TextRules
from vllm_hybrid.tools.fork.upstream import UpstreamModule


@dataclass
class ForkBuild:
    """The overlay at ``repo_root`` against vLLM's source tree at
    ``upstream_root`` (the unpacked sdist)."""

    repo_root: Path
    upstream_root: Path
    #: Reads one of vLLM's files as published (default: from
    #: ``upstream_root``); the series reads them from its first commit while
    #: the tree itself changes.
    read_upstream: object = None
    #: Whether this repository's tests go along (off where only the fork's
    #: code matters, which saves reading every test module).
    with_tests: bool = True
    modules: list[OverlayModule] = field(init=False)
    table: SymbolTable = field(init=False)
    origins: dict[str, Origin] = field(init=False)
    replacements: list[tuple[int, Replacement]] = field(init=False)
    #: How each entry was written, filled by :meth:`files`.
    placed: dict[str, Placed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._upstream_texts: dict[str, str] = {}
        self._removals: dict[str, object] = {}
        self._rendered: dict[str, str] = {}
        self._upstream_sources: dict[str, Source] = {}
        package = self.repo_root / PACKAGE
        self.modules = overlay_modules(package, lambda p: self._exists(f"vllm/{p}"))
        by_name = {m.name: m for m in self.modules}
        self.table = SymbolTable(by_name)
        self.text = TextRules(self.modules)
        self.origins = {
            m.name: Origin(m.name, Source((package / m.path).read_text(), m.path))
            for m in self.modules
            if m.commit is not None
        }
        self.table.relocated[(f"{PACKAGE}.logger", "init_logger")] = Home(
            "vllm.logger", "init_logger"
        )
        self._drop_variables()
        for module, names in wiring.FORK_DROPS.items():
            for name, why in names.items():
                self.table.dropped[(module, name)] = why
        self.replacements = []
        for entry in PATCHES:
            origin = self.origins.get(entry.replacement.split(":")[0])
            if origin is None:
                raise ForkError(f"{entry.replacement}: module not in the fork")
            rep = find_replacement(entry, origin)
            self.replacements.append((self.entry_commit(rep), rep))
            self._relocate_replacement(rep)
        self.symbols = self._added_symbols()
        self.merged = self._merged_definitions()
        self.tests, self.tests_left = [], {}
        if self.with_tests:
            self.tests, self.tests_left = select_tests(
                self, self.repo_root / "tests", self._exists
            )

    # -- commits ---------------------------------------------------------------

    def module_commit(self, name: str) -> int | None:
        """The commit index of the overlay module ``name`` (None: not in the
        fork)."""
        module = self.table.modules.get(name)
        if module is None or module.commit is None:
            return None
        return commit_index(module.commit.key)

    def entry_commit(self, rep: Replacement) -> int:
        """The commit of the module the replacement is defined in, or the
        latest commit of a module its code reads (through the definitions of
        its own module it calls), whichever is later."""
        origin = rep.origin
        index = self.module_commit(origin.name)
        if index is None:
            raise ForkError(f"{rep.entry.replacement}: its module is not in the fork")
        body = [s for s in origin.source.tree.body if not isinstance(s, ast.Import)]
        own = {n: s for s in body for n in bound_names(s) if not _is_import(s)}
        seen, todo = set(), list(_reads(rep))
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            binding = origin.bindings.get(name)
            if binding is None:
                continue
            if binding.defined and name in own and name not in rep.names:
                todo += loaded_names([own[name]])
                continue
            for module in (f"{binding.module}.{binding.attr}", binding.module):
                found = self.module_commit(module)
                if found is not None:
                    index = max(index, found)
                    break
        return index

    # -- names -----------------------------------------------------------------

    def _drop_variables(self) -> None:
        """Constants naming a variable the fork does not have."""
        envs = self.origins.get(f"{PACKAGE}.envs")
        if envs is None:
            return
        gone = {f"{row.name}": row.dropped for row in variable_rows() if row.dropped}
        for stmt in envs.source.tree.body:
            if (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Constant)
                and stmt.value.value in gone
            ):
                for name in bound_names(stmt):
                    self.table.dropped[(envs.name, name)] = gone[stmt.value.value]

    def _relocate_replacement(self, rep: Replacement) -> None:
        entry, origin = rep.entry, rep.origin
        module, attr_path = entry.home_module, entry.attr_path
        for name in rep.names:
            if "." in attr_path:
                self.table.dropped[(origin.name, name)] = (
                    f"it is the body of {attr_path} in the fork"
                )
                cls, attr = attr_path.split(".")
                self.table.methods[(origin.name, name)] = (module, cls, attr)
            else:
                self.table.relocated[(origin.name, name)] = Home(module, attr_path)

    def _added_symbols(self) -> list[tuple[int, str, Origin, list[ast.stmt]]]:
        """Names the registry adds to vLLM's modules, with the definitions
        of their module they need: they move there."""
        found = []
        for symbol in ADDED_SYMBOLS:
            module_name, name = symbol.source.split(":")
            origin = self.origins[module_name]
            closure = _closure(origin, name)
            for stmt in closure:
                for bound in bound_names(stmt):
                    self.table.relocated[(origin.name, bound)] = Home(
                        symbol.home_module, bound
                    )
            own = next(m for m in self.modules if m.name == module_name)
            index = commit_index(own.commit.key)
            found.append((index, symbol.home_module, origin, closure))
        return found

    def _merged_definitions(self) -> list[tuple[int, str, Origin, ast.stmt]]:
        """Definitions of merged modules, each with the commit of the first
        entry that reads it (or its module's commit)."""
        found = []
        for module in self.modules:
            if not module.merged:
                continue
            origin = self.origins[module.name]
            taken = [r for _, r in self.replacements if r.origin is origin]
            removal = self._removal(origin)
            leftovers = [
                s
                for s in origin.source.tree.body
                if id(s) not in removal.statements
                and not isinstance(s, (ast.Import, ast.ImportFrom))
                and not _is_docstring(s)
                and not (
                    isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test)
                )
            ]
            first_use: dict[str, int] = {}
            own = commit_index(module.commit.key)
            for index, rep in sorted(self.replacements, key=lambda x: x[0]):
                if rep not in taken:
                    continue
                for name in _reaches(origin, _reads(rep), leftovers):
                    first_use.setdefault(name, index)
            upstream_names = self.upstream_module(module.fork_name).runtime_names()
            for stmt in leftovers:
                names = bound_names(stmt)
                if set(names) & upstream_names:
                    if names == ["logger"]:
                        continue  # vLLM's module has its own logger
                    raise ForkError(
                        f"{origin.name}: {names} would replace vLLM's names in "
                        f"{module.fork_name}"
                    )
                index = min((first_use.get(n, own) for n in names), default=own)
                for name in names:
                    self.table.relocated[(origin.name, name)] = Home(
                        module.fork_name, name
                    )
                found.append((index, module.fork_name, origin, stmt))
        return found

    def _removal(self, origin: Origin):
        if origin.name not in self._removals:
            self._removals[origin.name] = self._plan_removal(origin)
        return self._removals[origin.name]

    def _plan_removal(self, origin: Origin):
        taken_names, taken_stmts = set(), []
        for _, rep in self.replacements:
            if rep.origin is origin:
                taken_names |= rep.names
                taken_stmts += [s for s in (rep.func, rep.assign) if s is not None]
                taken_stmts += rep.helpers
        for _, _, sym_origin, closure in getattr(self, "symbols", []):
            if sym_origin is origin:
                taken_stmts += closure
                for stmt in closure:
                    taken_names |= set(bound_names(stmt))
        drops = set(wiring.FORK_DROPS.get(origin.name, {}))
        rewritten = set(wiring.FORK_BODIES.get(origin.name, {}))
        return plan_removal(
            origin, self.table, taken_names, taken_stmts, drops, rewritten
        )

    def cascaded(self) -> dict[str, list[str]]:
        """Per overlay module, the names the fork loses only because they
        read names it drops."""
        found = {}
        for name, origin in self.origins.items():
            lost = self._removal(origin).cascaded
            if lost:
                found[name] = sorted(lost)
        return found

    # -- files -----------------------------------------------------------------

    def upstream_module(self, name: str) -> UpstreamModule:
        parts = name.split(".")
        path = Path(*parts).with_suffix(".py")
        if not (self.upstream_root / path).exists():
            path = Path(*parts) / "__init__.py"
        return UpstreamModule(name, path.as_posix(), self._source(path.as_posix()))

    def _text(self, path: str) -> str:
        if path not in self._upstream_texts:
            if self.read_upstream is not None:
                text = self.read_upstream(path)
            else:
                text = (self.upstream_root / path).read_text()
            self._upstream_texts[path] = text
        return self._upstream_texts[path]

    def _source(self, path: str) -> Source:
        if path not in self._upstream_sources:
            self._upstream_sources[path] = Source(self._text(path), path)
        return self._upstream_sources[path]

    def files(self, upto: int) -> dict[str, str]:
        """Every file that differs from vLLM's after the first ``upto``
        commits (0: none), by path relative to the tree's root."""
        out: dict[str, str] = {}
        upstream: dict[str, UpstreamModule] = {}

        def touch(name: str) -> UpstreamModule:
            if name not in upstream:
                upstream[name] = self.upstream_module(name)
            return upstream[name]

        for index, rep in self.replacements:
            if index < upto:
                self.placed[rep.entry.target] = place(
                    rep, touch(rep.entry.home_module), self.table
                )
        refs = self._upstream_refs(upto)
        module_refs = {
            local: Home(rep.entry.home_module, refs[local])
            for _, rep in self.replacements
            for local in [rep.entry.replacement.split(":")[1]]
            if "." not in rep.entry.attr_path
        }
        for module in self.modules:
            if module.commit is None or module.merged:
                continue
            if commit_index(module.commit.key) >= upto:
                continue
            out[f"vllm/{module.fork_path}"] = self._render(module, module_refs)
        for index, home, origin, closure in self.symbols:
            if index < upto:
                merge_definitions(origin, closure, touch(home), self.table, refs)
        for index, home, origin, stmt in self.merged:
            if index < upto:
                merge_definitions(origin, [stmt], touch(home), self.table, refs)
        for attribute in ADDED_ATTRIBUTES:
            if self._attribute_commit(attribute) < upto:
                wiring.declare_attribute(touch(attribute.cls.split(":")[0]), attribute)
        for commit in COMMITS[:upto]:
            for step in commit.wiring:
                wiring.wire(self, step, touch, out)
        for module in upstream.values():
            out[module.path] = module.render(self.text)
        for test in self.tests:
            if test.commit < upto:
                out[test.fork_path] = test.text
        inits = package_inits([t for t in self.tests if t.commit < upto], self._exists)
        out.update(inits)
        return out

    def _exists_module(self, name: str) -> bool:
        """Whether vLLM's tree (as published) has the module ``name``."""
        base = name.replace(".", "/")
        return self._exists(f"{base}.py") or self._exists(f"{base}/__init__.py")

    def _exists(self, path: str) -> bool:
        return (
            (self.upstream_root / path).exists()
            if self.read_upstream is None
            else (self._exists_upstream(path))
        )

    def _exists_upstream(self, path: str) -> bool:
        try:
            self._text(path)
        except Exception:  # noqa: BLE001 - absent from vLLM's tree
            return False
        return True

    def _render(self, module: OverlayModule, refs: dict[str, Home]) -> str:
        if module.name not in self._rendered:
            self._rendered[module.name] = self._render_once(module, refs)
        return self._rendered[module.name]

    def _render_once(self, module: OverlayModule, refs: dict[str, Home]) -> str:
        origin = self.origins[module.name]
        removal = self._removal(origin)
        bodies = wiring.FORK_BODIES.get(module.name, {})
        text = render_module(
            origin, module.fork_name, self.table, removal, bodies, refs
        )
        extra = wiring.FORK_IMPORTS.get(module.name)
        if extra:
            from vllm_hybrid.tools.fork.rewrite import _add_top_imports

            text = _add_top_imports(text, extra)
        doc = wiring.FORK_DOCSTRINGS.get(module.name)
        if doc is not None:
            text = _replace_docstring(text, doc)
        if module.name == f"{PACKAGE}.config.hybrid_kv":
            text = text.rstrip("\n") + "\n" + wiring.config_class()
        return self.text(text)

    def _upstream_refs(self, upto: int) -> dict[str, str]:
        """What ``upstream_of(__name__, name)`` means in merged code: the
        name of upstream's object where the entry is written."""
        refs = {}
        for _, rep in self.replacements:
            local = rep.entry.replacement.split(":")[1]
            refs[local] = rep.entry.attr_path.rsplit(".", 1)[-1]
            placed = self.placed.get(rep.entry.target)
            if placed is not None and placed.default_name is not None:
                refs[local] = placed.default_name
        return refs

    def _attribute_commit(self, attribute) -> int:
        where = attribute.where.split()
        for word in where:
            module = next((m for m in self.modules if m.name == word), None)
            if module is not None and module.commit is not None:
                return commit_index(module.commit.key)
        raise ForkError(f"{attribute.cls}.{attribute.name}: no module in 'where'")

    def entries_of(self, index: int) -> list[PatchEntry]:
        return [rep.entry for i, rep in self.replacements if i == index]


def _replace_docstring(text: str, doc: str) -> str:
    node = ast.parse(text).body[0]
    lines = text.splitlines(keepends=True)
    return '"""' + doc.rstrip("\n") + '\n"""\n' + "".join(lines[node.end_lineno :])


def _is_import(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.Import, ast.ImportFrom))


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _reads(rep: Replacement) -> set[str]:
    node = rep.func if rep.func is not None else rep.assign
    return loaded_names([node])


def _reaches(origin: Origin, names: set[str], statements: list[ast.stmt]) -> set[str]:
    """``names`` and every top-level name of ``statements`` they read,
    transitively."""
    by_name = {n: s for s in statements for n in bound_names(s)}
    seen, todo = set(), [n for n in names if n in by_name]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [
            n for n in loaded_names([by_name[name]]) if n in by_name and n not in seen
        ]
    return seen


def _closure(origin: Origin, name: str) -> list[ast.stmt]:
    """The top-level definition of ``name`` and the definitions of its
    module it reads, in source order."""
    body = [
        s
        for s in origin.source.tree.body
        if not isinstance(s, (ast.Import, ast.ImportFrom))
        and not (isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test))
    ]
    names = _reaches(origin, {name}, body)
    return [s for s in body if set(bound_names(s)) & names]


__all__ = ["CONFIG_CLASS", "ForkBuild"]
