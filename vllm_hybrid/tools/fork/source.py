"""Python source as text with its syntax tree: positions, spans and edits.

The fork is written by editing source text at places the syntax tree finds,
never by regenerating code from the tree: comments, blank lines and the
authors' layout survive, and an upstream file changes only where a fix
touches it.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
from dataclasses import dataclass
from functools import cached_property

#: Names every module sees without importing them.
BUILTINS = frozenset(dir(builtins)) | {"__name__", "__file__", "__doc__"}


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` (character offsets) by ``new``."""

    start: int
    end: int
    new: str


class Source:
    """One module's text and tree, with character offsets of its nodes.

    ``ast`` reports columns in UTF-8 bytes; offsets here are characters, so
    non-ASCII text in docstrings and comments is handled.
    """

    def __init__(self, text: str, name: str = "<source>") -> None:
        self.text = text
        self.name = name
        self.tree = ast.parse(text, filename=name)
        self.lines = text.splitlines(keepends=True)
        starts = [0]
        for line in self.lines:
            starts.append(starts[-1] + len(line))
        self._line_starts = starts

    def offset(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1] if lineno <= len(self.lines) else ""
        prefix = line.encode()[:col_bytes].decode(errors="ignore")
        return self._line_starts[lineno - 1] + len(prefix)

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),
            self.offset(node.end_lineno, node.end_col_offset),
        )

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_start(self, lineno: int) -> int:
        return self._line_starts[lineno - 1]

    def line_end(self, lineno: int) -> int:
        """Offset just past the newline of line ``lineno``."""
        return self._line_starts[lineno]

    def statement_lines(self, node: ast.stmt) -> tuple[int, int]:
        """Offsets of the whole lines a statement occupies, decorators and
        comment lines directly above it included."""
        first = node.lineno
        for decorator in getattr(node, "decorator_list", ()):
            first = min(first, decorator.lineno)
        while first > 1 and self.lines[first - 2].strip().startswith("#"):
            first -= 1
        return self.line_start(first), self.line_end(node.end_lineno)

    def indentation(self, node: ast.stmt) -> str:
        line = self.lines[node.lineno - 1]
        return line[: len(line) - len(line.lstrip())]

    @cached_property
    def top_level_bindings(self) -> dict[str, ast.stmt]:
        """Name -> the top-level statement that binds it (the last one)."""
        bound: dict[str, ast.stmt] = {}
        for stmt in self.tree.body:
            for name in bound_names(stmt):
                bound[name] = stmt
        return bound


def bound_names(stmt: ast.stmt) -> list[str]:
    """Names a top-level statement binds in its module's namespace."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return [
            n.id
            for t in targets
            for n in ast.walk(t)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        ]
    if isinstance(stmt, ast.If):
        return [n for s in [*stmt.body, *stmt.orelse] for n in bound_names(s)]
    if isinstance(stmt, ast.Try):
        inner = [*stmt.body, *stmt.orelse, *stmt.finalbody]
        inner += [s for h in stmt.handlers for s in h.body]
        return [n for s in inner for n in bound_names(s)]
    return []


def apply_edits(
    text: str, edits: list[Edit], start: int = 0, end: int | None = None
) -> str:
    """``text[start:end]`` with the edits inside that range applied.

    Edits must not overlap; edits outside the range are ignored.
    """
    end = len(text) if end is None else end
    inside = sorted(
        (e for e in edits if e.start >= start and e.end <= end),
        key=lambda e: (e.start, e.end),
    )
    out, pos = [], start
    for edit in inside:
        if edit.start < pos:
            raise ValueError(f"overlapping edits at offset {edit.start}")
        out.append(text[pos : edit.start])
        out.append(edit.new)
        pos = edit.end
    out.append(text[pos:end])
    return "".join(out)


def reindent(block: str, indent: str) -> str:
    """``block`` dedented, then indented by ``indent`` (blank lines stay
    empty)."""
    lines = textwrap.dedent(block).splitlines(keepends=True)
    return "".join(indent + line if line.strip() else line for line in lines)


def docstring_node(body: list[ast.stmt]) -> ast.Expr | None:
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[0]
    return None


def loaded_names(nodes: list[ast.AST]) -> set[str]:
    """Every name read anywhere in ``nodes`` (nested scopes included)."""
    return {
        n.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def free_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names a function (with its nested scopes) reads from its module.

    Conservative: a name bound anywhere inside the function (assignment,
    parameter, import, def, loop or ``with`` target, comprehension variable)
    counts as local everywhere in it.
    """
    local: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.arg):
            local.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            local.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif (
            (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node is not func
            )
            or isinstance(node, ast.ExceptHandler)
            and node.name
        ):
            local.add(node.name)
    reads = loaded_names([*func.body, *func.args.defaults, *func.args.kw_defaults])
    reads |= loaded_names(func.decorator_list)
    return reads - local - BUILTINS


def annotation_nodes(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    args = func.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [a for a in (args.vararg, args.kwarg) if a is not None]
    found = [a.annotation for a in every if a.annotation is not None]
    if func.returns is not None:
        found.append(func.returns)
    return found


def parameter_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = func.args
    names = [a.arg for a in [*args.posonlyargs, *args.args]]
    if args.vararg is not None:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append("**" + args.kwarg.arg)
    return names


def find_function(
    tree: ast.Module, attr_path: str
) -> tuple[ast.ClassDef | None, ast.FunctionDef | ast.AsyncFunctionDef | ast.Assign]:
    """The definition of ``func`` or ``Class.func`` at module top level (the
    last one, as Python would bind it)."""
    *owner, name = attr_path.split(".")
    body, cls = tree.body, None
    if owner:
        (cls_name,) = owner
        classes = [
            n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name
        ]
        if not classes:
            raise LookupError(f"class {cls_name} not found")
        cls = classes[-1]
        body = cls.body
    found = None
    for node in body:
        if (
            (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == name
            )
            or isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        ):
            found = node
    if found is None:
        raise LookupError(f"{attr_path} not found")
    return cls, found
