"""What an entry's replacement is in the overlay's code, and its shape.

:func:`find_replacement` finds the definition (a function, a function bound
through ``classmethod``, or an object); the shape is where its one call of
upstream's object sits among its statements, which is what an entry's
``placement`` names (:func:`implied_placement`) and what decides whether the
fork can write it into upstream's body (:mod:`.placement`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from vllm_hybrid.patches.entry import PatchEntry
from vllm_hybrid.tools.fork.code import ForkError, Origin, is_upstream_call
from vllm_hybrid.tools.fork.source import docstring_node, parameter_names

Func = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Replacement:
    """Where an entry's replacement is in the overlay."""

    entry: PatchEntry
    origin: Origin
    #: The function that is the replacement (None for an object).
    func: Func | None
    #: The statement binding an object replacement.
    assign: ast.Assign | None
    #: Top-level names of the overlay module that the replacement takes.
    names: set[str]
    #: Top-level statements that only exist for the registry's binding.
    helpers: list[ast.stmt]


def find_replacement(entry: PatchEntry, origin: Origin) -> Replacement:
    name = entry.replacement.split(":", 1)[1]
    tree = origin.source.tree
    defs = {
        s.name: s
        for s in tree.body
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    if name in defs:
        return Replacement(entry, origin, defs[name], None, {name}, [])
    assign = next(
        (
            s
            for s in tree.body
            if isinstance(s, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
        ),
        None,
    )
    if assign is None:
        raise ForkError(f"{entry.replacement}: no definition found")
    value = assign.value
    if isinstance(value, ast.Call) and _callee(value) == "classmethod":
        value = value.args[0]
    if isinstance(value, ast.Name) and value.id in defs:
        func = defs[value.id]
        helpers = [assign] + [
            s
            for s in tree.body
            if s is not assign
            and isinstance(s, ast.Assign)
            and any(
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == func.name
                for t in s.targets
            )
        ]
        return Replacement(entry, origin, func, None, {name, func.name}, helpers)
    return Replacement(entry, origin, None, assign, {name}, [])


def _callee(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def body_of(func: Func) -> list[ast.stmt]:
    doc = docstring_node(func.body)
    return func.body[1:] if doc is not None else list(func.body)


def upstream_calls(nodes: list[ast.AST], registry: set[str]) -> list[ast.Call]:
    return [
        n
        for node in nodes
        for n in ast.walk(node)
        if is_upstream_call(n, registry) is not None
    ]


def passes_through(call: ast.Call, up: ast.Call, func: Func) -> bool:
    """``call`` calls upstream's object (``up``, maybe ``.__func__``) with
    exactly the replacement's own parameters."""
    callee = call.func
    if isinstance(callee, ast.Attribute) and callee.attr == "__func__":
        callee = callee.value
    if callee is not up:
        return False
    names = parameter_names(func)
    given: dict[str, str] = {}
    positional = [n for n in names if not n.startswith("*")][
        : len(func.args.posonlyargs) + len(func.args.args)
    ]
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            given["*" + arg.value.id] = "*" + arg.value.id
        elif isinstance(arg, ast.Name) and i < len(positional):
            given[positional[i]] = arg.id
        else:
            return False
    for kw in call.keywords:
        if not isinstance(kw.value, ast.Name):
            return False
        key = "**" + kw.value.id if kw.arg is None else kw.arg
        given[key] = "**" + kw.value.id if kw.arg is None else kw.value.id
    return given == {n: n for n in names}


def returns_in(nodes: list[ast.stmt]) -> list[ast.Return]:
    found = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
        ):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def has_yield(func: Func) -> bool:
    return any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(func))


def bound_locally(func: Func) -> set[str]:
    names = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names - set(n.lstrip("*") for n in parameter_names(func))


def implied_placement(rep: Replacement) -> str:
    """The placement the replacement's code has: where its one call of
    upstream's object sits among its statements (arguments aside)."""
    if rep.func is None:
        return "body"
    body = body_of(rep.func)
    ups = upstream_calls(body, rep.origin.registry_names())
    if len(ups) != 1:
        return "body"
    index = next(i for i, s in enumerate(body) if ups[0] in list(ast.walk(s)))
    stmt = body[index]
    returns_early = bool(returns_in(body[:index]))

    def is_call(node) -> bool:
        callee = node.func if isinstance(node, ast.Call) else None
        if isinstance(callee, ast.Attribute) and callee.attr == "__func__":
            callee = callee.value
        return callee is ups[0]

    value = getattr(stmt, "value", None)
    if (
        index == len(body) - 1
        and isinstance(stmt, (ast.Return, ast.Expr))
        and is_call(value)
    ):
        return "top" if returns_early else "before"
    if (
        isinstance(stmt, ast.If)
        and not stmt.orelse
        and len(stmt.body) <= 2
        and any(is_call(getattr(s, "value", None)) for s in stmt.body)
    ):
        return "top"
    if (
        isinstance(stmt, (ast.Assign, ast.Expr))
        and is_call(value)
        and index < len(body) - 1
    ):
        return "after"
    return "body"


def is_tail(stmt: ast.stmt, up_call: ast.Call, func: Func) -> bool:
    value = stmt.value if isinstance(stmt, (ast.Return, ast.Expr)) else None
    return isinstance(value, ast.Call) and passes_through(value, up_call, func)


def is_dispatch(stmt: ast.If, up_call: ast.Call, func: Func) -> bool:
    """``if C: return upstream(...)`` or ``if C: upstream(...); return``."""
    inner = stmt.body
    if len(inner) == 1:
        return isinstance(inner[0], ast.Return) and is_tail(inner[0], up_call, func)
    return (
        len(inner) == 2
        and isinstance(inner[0], ast.Expr)
        and is_tail(inner[0], up_call, func)
        and isinstance(inner[1], ast.Return)
        and inner[1].value is None
    )


def binds_call(stmt: ast.stmt, up_call: ast.Call, func: Func) -> bool:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        return isinstance(stmt.value, ast.Call) and passes_through(
            stmt.value, up_call, func
        )
    return isinstance(stmt, ast.Expr) and is_tail(stmt, up_call, func)
