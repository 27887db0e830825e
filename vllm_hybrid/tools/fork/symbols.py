"""Where each name of the overlay lives in the fork, and the import that
reaches it from a given module.

Most names keep their module (moved to its path under ``vllm/``). The
exceptions are recorded here before any module is written: replacements
placed into vLLM's definitions, definitions of merged modules, names the
registry adds to vLLM's modules (with what they need), and names that have
no place in the fork at all (the registry, the plugin, dropped variables).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from vllm_hybrid.tools.fork.modules import PACKAGE, OverlayModule
from vllm_hybrid.tools.fork.source import Source

#: Names of the registry module that placed code must not keep.
REGISTRY_MODULE = f"{PACKAGE}.patches.registry"


@dataclass(frozen=True)
class Home:
    """A name in the fork: ``module.name`` (``name`` None: the module itself)."""

    module: str
    name: str | None
    #: ``module.name`` is itself a module (``from package import module``).
    is_module: bool = False


@dataclass(frozen=True)
class Binding:
    """How a module binds a top-level name: imported (``module`` and, for
    ``from`` imports, ``attr``) or defined here (``module`` is the module
    itself, ``attr`` the name, ``defined`` true)."""

    module: str
    attr: str | None
    defined: bool = False


def module_bindings(source: Source, module_name: str) -> dict[str, Binding]:
    """Top-level bindings of a module (imports under ``if TYPE_CHECKING``
    included: annotations read them)."""
    found: dict[str, Binding] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        found[alias.asname] = Binding(alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        found[top] = Binding(top, None)
            elif isinstance(stmt, ast.ImportFrom):
                base = resolve_relative(module_name, stmt.module, stmt.level)
                for alias in stmt.names:
                    found[alias.asname or alias.name] = Binding(base, alias.name)
            elif isinstance(
                stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                found[stmt.name] = Binding(module_name, stmt.name, defined=True)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = (
                    stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                )
                for target in targets:
                    for node in ast.walk(target):
                        if isinstance(node, ast.Name):
                            found[node.id] = Binding(module_name, node.id, defined=True)
            elif isinstance(stmt, ast.If):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)

    visit(source.tree.body)
    return found


def resolve_relative(module_name: str, target: str | None, level: int) -> str:
    if not level:
        return target or ""
    parts = module_name.split(".")
    base = parts[: len(parts) - level] if level else parts
    # a package's __init__ resolves from the package itself
    return ".".join([*base, target] if target else base)


@dataclass
class SymbolTable:
    """Every overlay name's home in the fork."""

    modules: dict[str, OverlayModule]
    #: (overlay module, name) -> its home, where it is not ``fork module.name``.
    relocated: dict[tuple[str, str], Home] = field(default_factory=dict)
    #: (overlay module, name) -> why the fork has no such name.
    dropped: dict[tuple[str, str], str] = field(default_factory=dict)
    #: (overlay module, name) -> (module, class, method): a replacement that
    #: is a method of one of vLLM's classes in the fork.
    methods: dict[tuple[str, str], tuple[str, str, str]] = field(default_factory=dict)

    def home(self, module: str, name: str | None) -> Home | None:
        """The fork's home of ``from module import name`` (``name`` None:
        ``import module``); None when the fork has none."""
        if not module.startswith(PACKAGE):
            return Home(module, name)
        if name is not None:
            if (module, name) in self.dropped:
                return None
            if (module, name) in self.relocated:
                return self.relocated[(module, name)]
            sub = self.modules.get(f"{module}.{name}")
            if sub is not None:
                return _module_home(sub)
        own = self.modules.get(module)
        if own is None or own.fork_name is None:
            return None
        if name is None:
            return _module_home(own)
        return Home(own.fork_name, name)

    def why_dropped(self, module: str, name: str | None) -> str:
        if name is not None and (module, name) in self.dropped:
            return self.dropped[(module, name)]
        own = self.modules.get(module)
        if own is not None and own.fork_path is None:
            return f"{module} is not part of the fork"
        return f"{module}.{name} has no place in the fork"


def _module_home(module: OverlayModule) -> Home | None:
    if module.fork_name is None or module.merged:
        return None
    parent, _, leaf = module.fork_name.rpartition(".")
    return Home(parent, leaf, is_module=True)


def import_text(home: Home, bound: str) -> str:
    """The import statement that binds ``bound`` to ``home``."""
    if home.name is None:
        if bound == home.module:
            return f"import {home.module}"
        return f"import {home.module} as {bound}"
    if home.name == bound:
        return f"from {home.module} import {bound}"
    return f"from {home.module} import {home.name} as {bound}"
