"""A registry entry's replacement, written into vLLM's own definition.

The overlay binds its replacement over upstream's object; the fork writes it
where upstream's definition is, in the shape the entry's ``placement`` names:

* ``top`` / ``before``: the replacement's statements before its call of
  upstream's object go to the top of upstream's body; a dispatch ``if C:
  return upstream(...)`` followed by more code becomes ``if not C: <that
  code>`` at the top, so upstream's body is the fall-through.
* ``after``: upstream's body runs first; its final ``return E`` becomes the
  replacement's ``x = E``, then the replacement's code follows.
* ``body``, or any of the above where upstream's body does not allow it (an
  early return, a name both use, arguments changed on the way): upstream's
  definition stays as ``_NAME_default`` and the replacement becomes the
  definition of NAME, calling it.

Object replacements (a module attribute bound to an instance) keep
upstream's definition the same way and bind the name after it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from vllm_hybrid.patches.entry import PatchEntry
from vllm_hybrid.tools.fork.code import (
    ForkError,
    Origin,
    Target,
    def_header,
    home_of,
    imports_for,
    move,
)
from vllm_hybrid.tools.fork.shapes import (
    Func,
    Replacement,
    binds_call,
    body_of,
    bound_locally,
    has_yield,
    is_dispatch,
    is_tail,
    returns_in,
    upstream_calls,
)
from vllm_hybrid.tools.fork.source import (
    BUILTINS,
    Edit,
    docstring_node,
    find_function,
    free_names,
    loaded_names,
    parameter_names,
    reindent,
)
from vllm_hybrid.tools.fork.symbols import SymbolTable
from vllm_hybrid.tools.fork.upstream import UpstreamModule


@dataclass
class Placed:
    """How an entry was written (for the commit message and the docs)."""

    entry: PatchEntry
    #: "inline" (into upstream's body) or "default" (upstream's definition
    #: kept as ``_NAME_default``).
    how: str
    default_name: str | None = None
    #: Why upstream's definition is kept (``how`` "default").
    reason: str | None = None


def place(rep: Replacement, module: UpstreamModule, table: SymbolTable) -> Placed:
    """Write ``rep`` into ``module`` (edits collected there)."""
    attr_path = rep.entry.attr_path
    owner, upstream_def = find_function(module.source.tree, attr_path)
    target = Target(module.name, module.source)
    if rep.func is None:
        return _place_object(rep, module, target, table, upstream_def)
    if not isinstance(upstream_def, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ForkError(f"{rep.entry.target}: upstream's definition is no function")
    reason = "its placement is the whole body"
    if rep.entry.placement in ("top", "before", "after"):
        placed = _place_inline(rep, module, target, table, upstream_def)
        if isinstance(placed, Placed):
            return placed
        reason = placed
    placed = _place_with_default(rep, module, target, table, owner, upstream_def)
    placed.reason = reason
    return placed


def _default_name(name: str) -> str:
    return f"_{name.lstrip('_')}_default"


def _qualified(owner: ast.ClassDef | None, name: str) -> str:
    return f"{owner.name}.{name}" if owner is not None else name


def _place_inline(
    rep: Replacement,
    module: UpstreamModule,
    target: Target,
    table: SymbolTable,
    up: Func,
) -> Placed | str:
    func, origin = rep.func, rep.origin
    registry = origin.registry_names()
    body = body_of(func)
    ups = upstream_calls(body, registry)
    if len(ups) != 1:
        return "it reads upstream's object more than once"
    if parameter_names(func) != parameter_names(up):
        return "its parameters are not upstream's"
    if has_yield(up):
        return "upstream's definition is a generator"
    up_call = ups[0]
    index = next(i for i, s in enumerate(body) if up_call in list(ast.walk(s)))
    stmt = body[index]
    pre, rest, post, dispatch = body[:index], [], [], None
    up_body = body_of(up)
    up_returns = returns_in(up_body)
    kind = None
    if index == len(body) - 1 and is_tail(stmt, up_call, func):
        if isinstance(stmt, ast.Expr) and any(r.value is not None for r in up_returns):
            return "it drops the value upstream's body returns"
        kind = "top"
    elif (
        isinstance(stmt, ast.If)
        and not stmt.orelse
        and is_dispatch(stmt, up_call, func)
    ):
        dispatch, rest = stmt, body[index + 1 :]
        kind = "top"
    elif rep.entry.placement == "after" and binds_call(stmt, up_call, func):
        post = body[index + 1 :]
        final = up_body[-1] if up_body else None
        if isinstance(stmt, ast.Assign):
            if not (isinstance(final, ast.Return) and final.value is not None):
                return "upstream's body does not end in a return"
            if up_returns != [final]:
                return "upstream's body returns early"
        elif up_returns:
            return "upstream's body returns"
        kind = "after"
    if kind is None:
        return "its call of upstream's object is not where the placement says"
    # scopes: merged into one function, neither body may shadow a name the
    # other reads from the module, and code after upstream's body must not
    # read a local upstream's body rebinds
    ours = free_names(func) - registry
    imported = {
        n
        for n in ours
        if n not in BUILTINS
        and not (n == "logger" and "logger" in target.bindings)
        and not target.binds(n, home_of(origin, n, table) or _nowhere(n))
    }
    our_bound = bound_locally(func) | imported
    up_free, up_bound = free_names(up), bound_locally(up)
    clash = (ours - imported) & up_bound
    clash |= {n for n in our_bound & up_free if n not in ours}
    clash |= {n for n in imported & up_free}
    if kind == "after":
        before = set()
        for node in [*pre, stmt]:
            before |= {
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
        clash |= (before | imported) & up_bound
    if clash:
        return f"both bodies use {sorted(clash)}"
    src = module.source
    indent = src.indentation(up_body[0]) if up_body else src.indentation(up) + "    "

    def moved(nodes: list[ast.stmt], at_indent: str) -> _Text:
        if not nodes:
            return _Text("", [])
        piece = move(
            origin,
            nodes,
            target,
            table,
            upstream=_refuse(rep),
            free=loaded_names(nodes) & imported,
            indent=at_indent,
        )
        return _Text(piece.text, piece.imports)

    pieces = [moved(pre, indent)]
    if dispatch is not None:
        if not rest:
            return "nothing follows its dispatch"
        cond = _inverted(origin, dispatch.test)
        inner = moved(rest, indent + "    ")
        tail = (
            ""
            if isinstance(rest[-1], (ast.Return, ast.Raise))
            else f"{indent}    return\n"
        )
        test_imports = imports_for(
            origin, loaded_names([dispatch.test]) & imported, target, table
        )
        pieces.append(
            _Text(
                f"{indent}if {cond}:\n{inner.text}{tail}",
                [*inner.imports, *test_imports],
            )
        )
    after = moved(post, indent)
    imports = sorted({line for p in [*pieces, after] for line in p.imports})
    head = "".join(f"{indent}{line}\n" for line in imports)
    if imports:
        head += "\n"
    head += "".join(p.text for p in pieces)
    doc = docstring_node(up.body)
    at = (
        src.line_end(doc.end_lineno)
        if doc is not None
        else src.statement_lines(up_body[0])[0]
    )
    module.edits.append(Edit(at, at, head))
    if kind == "after":
        final = up_body[-1]
        if isinstance(stmt, ast.Assign):
            a, b = src.statement_lines(final)
            bound = origin.source.segment(stmt.targets[0])
            text = f"{indent}{bound} = {src.segment(final.value)}\n"
            module.edits.append(Edit(a, b, text + after.text))
        else:
            end = src.line_end(final.end_lineno)
            module.edits.append(Edit(end, end, after.text))
    return Placed(rep.entry, "inline")


@dataclass
class _Text:
    text: str
    imports: list[str]


def _nowhere(name: str):
    from vllm_hybrid.tools.fork.symbols import Home

    return Home("<nowhere>", name)


def _refuse(rep: Replacement):
    def upstream(name: str) -> str:
        raise ForkError(f"{rep.entry.target}: upstream's object is read twice")

    return upstream


def _inverted(origin: Origin, test: ast.expr) -> str:
    seg = origin.source.segment
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return seg(test.operand)
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
    ):
        op = "is not" if isinstance(test.ops[0], ast.Is) else "is"
        return f"{seg(test.left)} {op} {seg(test.comparators[0])}"
    return f"not ({seg(test)})"


def _place_with_default(
    rep: Replacement,
    module: UpstreamModule,
    target: Target,
    table: SymbolTable,
    owner: ast.ClassDef | None,
    up: Func,
) -> Placed:
    func, origin, src = rep.func, rep.origin, module.source
    public = up.name
    default = _default_name(public)
    _rename_def(module, up, default)
    registry = origin.registry_names()
    indent = src.indentation(up)
    reference = _qualified(owner, default)
    decorators = [
        f"{indent}@{d.id}\n"
        for d in up.decorator_list
        if isinstance(d, ast.Name) and d.id in ("classmethod", "staticmethod")
    ]
    header = def_header(
        rep.origin, func, module, target, table, public, method=owner is not None
    )
    doc = docstring_node(func.body)
    body = body_of(func)
    free = free_names(func) - registry
    moved = move(
        origin,
        body,
        target,
        table,
        upstream=lambda name: reference,
        free=free,
        indent=indent + "    ",
    )
    text = "".join(decorators) + reindent(header, indent)
    if doc is not None:
        a, b = origin.source.statement_lines(doc)
        text += reindent(origin.source.text[a:b], indent + "    ")
    if moved.imports:
        text += "".join(f"{indent}    {line}\n" for line in sorted(set(moved.imports)))
        text += "\n"
    text += moved.text
    at = src.line_end(up.end_lineno)
    module.edits.append(Edit(at, at, "\n" + text))
    return Placed(rep.entry, "default", default)


def _rename_def(module: UpstreamModule, node: Func, new: str) -> None:
    src = module.source
    line_start = src.line_start(node.lineno)
    line = src.lines[node.lineno - 1]
    key = f"def {node.name}("
    col = line.find(key)
    if col < 0:
        raise ForkError(f"{module.name}: cannot find {key!r}")
    a = line_start + col + len("def ")
    module.edits.append(Edit(a, a + len(node.name), new))


def _place_object(
    rep: Replacement,
    module: UpstreamModule,
    target: Target,
    table: SymbolTable,
    up: ast.stmt,
) -> Placed:
    if not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ForkError(f"{rep.entry.target}: upstream's definition is no function")
    default = _default_name(up.name)
    _rename_def(module, up, default)
    origin = rep.origin
    free = loaded_names([rep.assign.value]) - origin.registry_names() - BUILTINS
    moved = move(
        origin,
        [rep.assign],
        target,
        table,
        upstream=lambda name: default,
        free=free,
        indent="",
    )
    module.imports.extend(moved.imports)
    at = module.source.line_end(up.end_lineno)
    module.edits.append(Edit(at, at, "\n\n" + moved.text))
    return Placed(rep.entry, "default", default)
