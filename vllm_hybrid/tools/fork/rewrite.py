"""An overlay module as the fork has it.

What goes: the replacements (placed into vLLM's definitions), what only the
registry's binding needed, names the fork has no use for and everything that
reads them. What changes: imports of the overlay become imports of the fork
(:mod:`.symbols`), names that moved are imported from where they went, and
function bodies the fork writes differently (:data:`FORK_BODIES`) are
swapped. A merged module's definitions are appended to vLLM's module, each
function importing what it reads from the overlay's modules inside itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from vllm_hybrid.tools.fork.code import (
    ForkError,
    Origin,
    Target,
    def_header,
    is_upstream_call,
    move,
)
from vllm_hybrid.tools.fork.source import (
    BUILTINS,
    Edit,
    apply_edits,
    bound_names,
    docstring_node,
    free_names,
    loaded_names,
    reindent,
)
from vllm_hybrid.tools.fork.symbols import (
    REGISTRY_MODULE,
    Home,
    SymbolTable,
    import_text,
)
from vllm_hybrid.tools.fork.upstream import UpstreamModule


@dataclass
class Removal:
    """What an overlay module loses in the fork."""

    #: Top-level statements removed whole (by identity).
    statements: set[int] = field(default_factory=set)
    #: Tuple/list assignments with elements removed: id -> kept elements.
    trimmed: dict[int, list[ast.expr]] = field(default_factory=dict)
    #: Names no remaining code may read.
    names: set[str] = field(default_factory=set)
    #: Names removed only because they read removed names (reported, so a
    #: change that makes the fork lose code does not go unseen).
    cascaded: set[str] = field(default_factory=set)


def plan_removal(
    origin: Origin,
    table: SymbolTable,
    taken: set[str],
    taken_statements: list[ast.stmt],
    fork_drops: set[str],
    rewritten: set[str] = frozenset(),
) -> Removal:
    """``taken``: names the fork defines elsewhere (placed or moved);
    ``fork_drops``: names the fork has no use for; ``rewritten``: functions
    whose body the fork writes differently (kept whatever they read).
    Everything else reading a dropped name or the registry goes too,
    transitively."""
    removal = Removal()
    # a call of upstream_of survives (it names upstream's object where the
    # entry is written); other registry calls do not
    registry = {n for n in origin.registry_names() if not n.endswith("upstream_of")}
    body = origin.source.tree.body
    removal.statements = {id(s) for s in taken_statements}
    gone = set(fork_drops) | {
        name for (module, name) in table.dropped if module == origin.name
    }
    gone -= {name for name in taken if table.home(origin.name, name) is not None}
    for stmt in body:
        if id(stmt) in removal.statements:
            gone |= set(bound_names(stmt)) - taken
    changed = True
    while changed:
        changed = False
        for stmt in body:
            if id(stmt) in removal.statements or isinstance(
                stmt, (ast.Import, ast.ImportFrom)
            ):
                continue
            binds = set(bound_names(stmt))
            if binds & rewritten:
                continue
            if binds & gone and not binds - gone:
                removal.statements.add(id(stmt))
                changed = True
                continue
            reads = loaded_names([stmt]) & (gone | registry)
            if not reads:
                continue
            kept = _trim(stmt, reads)
            if kept is not None:
                removal.trimmed[id(stmt)] = kept
                continue
            removal.statements.add(id(stmt))
            gone |= binds
            removal.cascaded |= binds
            changed = True
    # registry plumbing: a function that reads upstream's object and that
    # nothing left reads (e.g. a cache handle the registry binding needed)
    uses = loaded_names(taken_statements)
    upstream_names = origin.registry_names() - registry
    for stmt in body:
        if (
            isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            and id(stmt) not in removal.statements
            and loaded_names([stmt]) & upstream_names
            and stmt.name not in uses
            and not any(
                stmt.name in loaded_names([other])
                for other in body
                if other is not stmt and id(other) not in removal.statements
            )
        ):
            removal.statements.add(id(stmt))
            gone.add(stmt.name)
    removal.names = gone
    return removal


def _trim(stmt: ast.stmt, reads: set[str]) -> list[ast.expr] | None:
    """Elements of a tuple/list assignment left when the names ``reads``
    are removed from it, or None when the statement reads them otherwise."""
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        return None
    value = stmt.value
    if not isinstance(value, (ast.Tuple, ast.List)):
        return None
    kept = [e for e in value.elts if not (isinstance(e, ast.Name) and e.id in reads)]
    if loaded_names(kept) & reads:
        return None
    return kept


def render_module(
    origin: Origin,
    fork_name: str,
    table: SymbolTable,
    removal: Removal,
    bodies: dict[str, str],
    upstream_refs: dict[str, Home],
) -> str:
    """The fork's text of an overlay module that keeps a module of its own.

    ``upstream_refs``: what ``upstream_of(__name__, name)`` stands for in the
    fork (upstream's object where its entry is written)."""
    src = origin.source
    edits: list[Edit] = []
    kept = []
    ref_imports = []
    for stmt in src.tree.body:
        if id(stmt) in removal.statements:
            a, b = src.statement_lines(stmt)
            edits.append(Edit(a, b, ""))
            continue
        kept.append(stmt)
        if id(stmt) in removal.trimmed:
            value = stmt.value
            items = ", ".join(src.segment(e) for e in removal.trimmed[id(stmt)])
            a, b = src.span(value)
            edits.append(
                Edit(
                    a,
                    b,
                    f"({items},)" if isinstance(value, ast.Tuple) else f"[{items}]",
                )
            )
    for stmt in kept:
        if (
            isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            and stmt.name in bodies
        ):
            edits.append(_body_edit(origin, stmt, bodies[stmt.name]))
    edits += _import_edits(origin, fork_name, table, kept, removal)
    registry = origin.registry_names()
    for node in ast.walk(ast.Module(body=kept, type_ignores=[])):
        name = is_upstream_call(node, registry)
        if name is None:
            continue
        home = upstream_refs.get(name)
        if home is None:
            raise ForkError(f"{origin.name}: upstream_of(..., {name!r}) names no entry")
        a, b = src.span(node)
        edits.append(Edit(a, b, home.name))
        ref_imports.append(import_text(home, home.name))
    # names that moved away but are still read here come back by import
    needed = loaded_names(kept) - BUILTINS
    moved_in = []
    for name in sorted(needed):
        binding = origin.bindings.get(name)
        if binding is None or not binding.defined:
            continue
        stmt = src.top_level_bindings.get(name)
        if stmt is None or id(stmt) not in removal.statements:
            continue
        home = table.home(origin.name, name)
        if home is None or home.module == fork_name:
            continue
        moved_in.append(import_text(home, name))
    text = apply_edits(src.text, [e for e in edits if e.start >= 0])
    if moved_in or ref_imports:
        text = _add_top_imports(text, [*moved_in, *sorted(set(ref_imports))])
    return text


def _body_edit(origin: Origin, func: ast.FunctionDef, body: str) -> Edit:
    src = origin.source
    first = func.body[0]
    a = src.statement_lines(first)[0]
    b = src.line_end(func.end_lineno)
    indent = src.indentation(first)
    return Edit(a, b, reindent(body, indent))


def _import_edits(
    origin: Origin,
    fork_name: str,
    table: SymbolTable,
    kept: list[ast.stmt],
    removal: Removal,
) -> list[Edit]:
    """Every import of an overlay module (top level and nested) rewritten;
    imports of removed names removed."""
    src = origin.source
    edits = []
    for node in ast.walk(ast.Module(body=kept, type_ignores=[])):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if not node.module.startswith("vllm_hybrid"):
                continue
            lines = []
            nested = node.col_offset > 0
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == REGISTRY_MODULE or bound in removal.names:
                    continue
                home = table.home(node.module, alias.name)
                method = table.methods.get((node.module, alias.name))
                if home is None and method is not None and nested:
                    # a replacement that is the method itself in the fork
                    module, cls, attr = method
                    lines += [f"from {module} import {cls}", f"{bound} = {cls}.{attr}"]
                    continue
                if home is None:
                    raise ForkError(
                        f"{origin.name} imports {node.module}.{alias.name}, but "
                        f"{table.why_dropped(node.module, alias.name)}"
                    )
                if (
                    home.module == fork_name
                    and home.name == bound
                    and not home.is_module
                ):
                    continue
                lines.append(import_text(home, bound))
            edits.append(_replace_statement(src, node, lines))
        elif isinstance(node, ast.Import) and any(
            a.name.startswith("vllm_hybrid") for a in node.names
        ):
            lines = []
            for alias in node.names:
                home = table.home(alias.name, None)
                bound = alias.asname or alias.name.split(".")[0]
                if home is None:
                    raise ForkError(
                        f"{origin.name} imports {alias.name}, not in the fork"
                    )
                lines.append(import_text(home, bound))
            edits.append(_replace_statement(src, node, lines))
    return edits


def _replace_statement(src, node: ast.stmt, lines: list[str]) -> Edit:
    if lines:
        a, b = src.span(node)
        indent = src.indentation(node)
        return Edit(a, b, ("\n" + indent).join(lines))
    a, b = src.line_start(node.lineno), src.line_end(node.end_lineno)
    return Edit(a, b, "")


def _add_top_imports(text: str, lines: list[str]) -> str:
    tree = ast.parse(text)
    last = None
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            last = stmt
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
    source_lines = text.splitlines(keepends=True)
    at = last.end_lineno if last is not None else 0
    block = "".join(f"{line}\n" for line in lines)
    return "".join(source_lines[:at]) + block + "".join(source_lines[at:])


def merge_definitions(
    origin: Origin,
    statements: list[ast.stmt],
    module: UpstreamModule,
    table: SymbolTable,
    upstream_refs: dict[str, str],
) -> None:
    """Append ``statements`` (top-level definitions of a merged overlay
    module) to vLLM's ``module``: functions import what they read from the
    overlay inside themselves; other statements at the module's top."""
    target = Target(module.name, module.source)
    for stmt in statements:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module.appended.append(
                _merged_function(origin, stmt, module, target, table, upstream_refs)
            )
            continue
        free = loaded_names([stmt]) - BUILTINS - origin.registry_names()
        free -= set(bound_names(stmt))
        moved = move(
            origin,
            [stmt],
            target,
            table,
            upstream=_ref(upstream_refs),
            free=free,
            indent="",
        )
        module.imports.extend(moved.imports)
        module.appended.append(moved.text)


def _ref(refs: dict[str, str]):
    def upstream(name: str) -> str:
        if name not in refs:
            raise ForkError(f"upstream_of(..., {name!r}) names no placed entry")
        return refs[name]

    return upstream


def _merged_function(
    origin: Origin,
    func: ast.FunctionDef | ast.AsyncFunctionDef,
    module: UpstreamModule,
    target: Target,
    table: SymbolTable,
    refs: dict[str, str],
) -> str:
    src = origin.source
    doc = docstring_node(func.body)
    body = func.body[1:] if doc is not None else list(func.body)
    free = free_names(func) - origin.registry_names()
    moved = move(
        origin, body, target, table, upstream=_ref(refs), free=free, indent="    "
    )
    head = def_header(origin, func, module, target, table, func.name)
    if doc is not None:
        a, b = src.statement_lines(doc)
        head += src.text[a:b]
    imports = "".join(f"    {line}\n" for line in sorted(set(moved.imports)))
    if imports:
        imports += "\n"
    return head + imports + moved.text
