"""Moving a piece of the overlay's code into another module of the fork.

The piece (a function's statements, a definition, a module-level statement)
keeps its text; what changes is how it reaches names: the registry's
``upstream_of`` becomes the name of upstream's object where the piece now
sits, imports of the overlay become imports of the fork, and every name the
piece read from its old module is imported where it is used (inside the
function, so that no import cycle can arise at module load), unless the new
module already binds it to the same object.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_hybrid.tools.fork.source import (
    BUILTINS,
    Edit,
    Source,
    annotation_nodes,
    apply_edits,
    reindent,
)
from vllm_hybrid.tools.fork.symbols import (
    REGISTRY_MODULE,
    Binding,
    Home,
    SymbolTable,
    import_text,
    module_bindings,
)
from vllm_hybrid.tools.fork.upstream import UpstreamModule


class ForkError(Exception):
    """The overlay's code cannot be written into the fork as it stands; the
    message names the place and what to change."""


@dataclass
class Origin:
    """The overlay module a piece comes from."""

    name: str
    source: Source
    bindings: dict[str, Binding] = field(init=False)

    def __post_init__(self) -> None:
        self.bindings = module_bindings(self.source, self.name)
        self._registry: set[str] | None = None

    def registry_names(self) -> set[str]:
        """Names this module binds to the registry (``upstream_of``,
        ``repair``), at top level or inside functions."""
        if self._registry is None:
            self._registry = self._find_registry_names()
        return set(self._registry)

    def _find_registry_names(self) -> set[str]:
        names = {
            name
            for name, b in self.bindings.items()
            if b.module == REGISTRY_MODULE and not b.defined
        }
        for node in ast.walk(self.source.tree):
            if isinstance(node, ast.ImportFrom) and node.module == REGISTRY_MODULE:
                names.update(a.asname or a.name for a in node.names)
        return names


def is_upstream_call(node: ast.AST, registry: set[str]) -> str | None:
    """``upstream_of(__name__, "name")`` -> ``"name"``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in registry
        and node.func.id.endswith("upstream_of")
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Constant)
    ):
        return str(node.args[1].value)
    return None


@dataclass
class Target:
    """The module a piece is written into, as the fork has it."""

    name: str
    source: Source
    bindings: dict[str, Binding] = field(init=False)

    def __post_init__(self) -> None:
        self.bindings = module_bindings(self.source, self.name)

    def binds(self, name: str, home: Home) -> bool:
        found = self.bindings.get(name)
        if found is None:
            return False
        if found.defined:
            return home.module == self.name and home.name == name
        return (found.module, found.attr) == (home.module, home.name)


@dataclass
class Moved:
    """A piece rendered for its new module."""

    text: str
    #: Import statements the piece needs at the top of its new scope.
    imports: list[str]


def home_of(origin: Origin, name: str, table: SymbolTable) -> Home | None:
    """Where a name the piece reads from its old module lives in the fork."""
    binding = origin.bindings.get(name)
    if binding is None:
        return None
    if binding.defined:
        return table.home(origin.name, name)
    return table.home(binding.module, binding.attr)


def move(
    origin: Origin,
    nodes: list[ast.stmt],
    target: Target,
    table: SymbolTable,
    *,
    upstream: Callable[[str], str],
    free: set[str],
    indent: str,
    drop: set[int] = frozenset(),
) -> Moved:
    """The text of ``nodes`` (consecutive statements of ``origin``) for
    ``target``, indented by ``indent``.

    ``upstream`` gives the expression that stands for ``upstream_of(__name__,
    name)``; ``free`` are the names the pieces read from their module;
    ``drop`` are ids of statements inside the nodes to leave out.
    """
    src = origin.source
    registry = origin.registry_names()
    start = src.statement_lines(nodes[0])[0]
    end = src.line_end(nodes[-1].end_lineno)
    edits: list[Edit] = []
    for stmt in _walk(nodes):
        if id(stmt) in drop or _calls_registry(stmt, registry, skip_upstream=True):
            a, b = src.statement_lines(stmt)
            edits.append(Edit(a, b, ""))
    removed = [(e.start, e.end) for e in edits]

    def inside_removed(node: ast.AST) -> bool:
        if not hasattr(node, "lineno"):
            return False
        a, _ = src.span(node)
        return any(s <= a < e for s, e in removed)

    for node in _walk(nodes):
        if inside_removed(node):
            continue
        name = is_upstream_call(node, registry)
        if name is not None:
            a, b = src.span(node)
            edits.append(Edit(a, b, upstream(name)))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            text = _rewrite_import(node, origin, target, table)
            if text is not None:
                a, b = src.span(node)
                edits.append(Edit(a, b, text))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in free
        ):
            home = home_of(origin, node.value.id, table)
            if home is not None and home.name is None and home.module == target.name:
                a, _ = src.span(node)
                edits.append(Edit(a, a + len(node.value.id) + 1, ""))
    imports = imports_for(origin, free, target, table)
    text = apply_edits(src.text, edits, start, end)
    return Moved(reindent(text, indent), imports)


def imports_for(
    origin: Origin, free: set[str], target: Target, table: SymbolTable
) -> list[str]:
    """Import statements that give code moved from ``origin`` into
    ``target`` the names ``free`` it reads from its old module."""
    registry = origin.registry_names()
    imports = []
    for name in sorted(free):
        if name in BUILTINS or name in registry:
            continue
        home = home_of(origin, name, table)
        if home is None:
            raise ForkError(
                f"{origin.name}: {name} is used by code that goes into "
                f"{target.name}, but {table.why_dropped(origin.name, name)}"
            )
        if home.name is None and home.module == target.name:
            continue
        if home.module == target.name and home.name == name and not home.is_module:
            continue
        if target.binds(name, home):
            continue
        if name == "logger" and "logger" in target.bindings:
            continue  # the module's own logger
        imports.append(import_text(home, name))
    return imports


def _walk(nodes: list[ast.stmt]):
    for node in nodes:
        yield from ast.walk(node)


def _calls_registry(stmt: ast.AST, registry: set[str], skip_upstream: bool) -> bool:
    """A statement that is only a call of a registry function (``repair()``),
    or an import from the registry."""
    if isinstance(stmt, ast.ImportFrom) and stmt.module == REGISTRY_MODULE:
        return True
    if (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id in registry
    ):
        return not (skip_upstream and stmt.value.func.id.endswith("upstream_of"))
    return False


def _rewrite_import(
    node: ast.ImportFrom, origin: Origin, target: Target, table: SymbolTable
) -> str | None:
    """A nested ``from vllm_hybrid... import`` as the fork writes it, or None
    when it imports no overlay module."""
    if not node.module.startswith("vllm_hybrid"):
        return None
    lines = []
    for alias in node.names:
        bound = alias.asname or alias.name
        home = table.home(node.module, alias.name)
        if home is None:
            raise ForkError(
                f"{origin.name} imports {node.module}.{alias.name}, but "
                f"{table.why_dropped(node.module, alias.name)}"
            )
        if home.module == target.name and home.name == bound and not home.is_module:
            continue
        lines.append(import_text(home, bound))
    return "\n".join(lines)


def def_header(
    origin: Origin,
    func: ast.FunctionDef | ast.AsyncFunctionDef,
    module: UpstreamModule,
    target: Target,
    table: SymbolTable,
    public: str,
    method: bool = False,
) -> str:
    """``func``'s ``def`` line(s), named ``public``, for ``module`` (as a
    method of one of its classes: ``self``/``cls`` unannotated).

    The overlay's modules postpone annotations; where ``module`` does not,
    an annotation naming what ``module`` lacks at run time is quoted. Names
    annotations use that ``module`` does not bind are imported there for
    type checking.
    """
    src = origin.source
    first = func.body[0]
    start, end = src.line_start(func.lineno), src.statement_lines(first)[0]
    runtime = module.runtime_names()
    edits = []
    skip = set()
    positional = [*func.args.posonlyargs, *func.args.args]
    if method and positional and positional[0].annotation is not None:
        first_arg = positional[0]
        a, b = src.span(first_arg)
        edits.append(Edit(a, b, first_arg.arg))
        skip.add(id(first_arg.annotation))
    for ann in annotation_nodes(func):
        if id(ann) in skip:
            continue
        names = {n.id for n in ast.walk(ann) if isinstance(n, ast.Name)} - BUILTINS
        missing = set()
        for name in sorted(names):
            home = home_of(origin, name, table)
            if home is None:
                raise ForkError(
                    f"{origin.name}.{func.name}: annotation {name}: "
                    f"{table.why_dropped(origin.name, name)}"
                )
            if home.module == target.name and home.name == name:
                continue
            if target.binds(name, home):
                if name not in runtime:
                    missing.add(name)  # bound for type checking only
                continue
            if not home.module.startswith("vllm"):
                # the standard library and third parties: no cycle to fear
                module.imports.append(import_text(home, name))
                continue
            module.type_imports.append(import_text(home, name))
            if name not in runtime:
                missing.add(name)
        if missing and not module.has_future_annotations:
            a, b = src.span(ann)
            edits.append(Edit(a, b, repr(src.segment(ann))))
    text = apply_edits(src.text, edits, start, end)
    return text.replace(f"def {func.name}(", f"def {public}(", 1)
