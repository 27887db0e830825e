"""One of vLLM's modules as the fork changes it.

Changes are collected from every fix that touches the module (placed
replacements, declared attributes, definitions that join it) as edits of
vLLM's text plus imports it needs, and written out in one pass, so fixes
never edit each other's output.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_hybrid.tools.fork.source import Edit, Source, apply_edits


@dataclass
class UpstreamModule:
    """vLLM's module ``name`` (``path`` under the source tree) and what the
    fork changes in it."""

    name: str
    path: str
    source: Source
    edits: list[Edit] = field(default_factory=list)
    #: Import statements the module needs at its top.
    imports: list[str] = field(default_factory=list)
    #: Import statements only annotations need (under ``if TYPE_CHECKING``).
    type_imports: list[str] = field(default_factory=list)
    #: Top-level code appended at the end of the module.
    appended: list[str] = field(default_factory=list)

    @property
    def has_future_annotations(self) -> bool:
        return any(
            isinstance(s, ast.ImportFrom)
            and s.module == "__future__"
            and any(a.name == "annotations" for a in s.names)
            for s in self.source.tree.body
        )

    def runtime_names(self) -> set[str]:
        """Names bound at top level outside ``if TYPE_CHECKING`` blocks."""
        names: set[str] = set()
        for stmt in self.source.tree.body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(
                stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = (
                    stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                )
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        return names

    def render(self, words: Callable[[str], str] = str) -> str:
        """vLLM's text with the changes; ``words`` rewrites the text the
        changes insert (never vLLM's own)."""
        text = self.source.text
        edits = [Edit(e.start, e.end, words(e.new)) for e in self.edits]
        imports = _unique([words(line) for line in self.imports])
        type_imports = _unique([words(line) for line in self.type_imports])
        anchor = self._after_imports()
        block = ""
        if imports:
            block += "".join(f"{line}\n" for line in imports)
        checking = self._type_checking_block()
        if type_imports and checking is not None:
            at = self.source.line_end(checking.end_lineno)
            indent = self.source.indentation(checking.body[0])
            edits.append(
                Edit(at, at, "".join(f"{indent}{line}\n" for line in type_imports))
            )
        elif type_imports:
            if "TYPE_CHECKING" not in self.runtime_names():
                block += "from typing import TYPE_CHECKING\n"
            block += "\nif TYPE_CHECKING:\n"
            block += "".join(f"    {line}\n" for line in type_imports)
        if block:
            edits.append(Edit(anchor, anchor, block))
        if self.appended:
            end = len(text)
            tail = "" if text.endswith("\n") else "\n"
            tail += "".join(f"\n\n{words(piece).rstrip()}\n" for piece in self.appended)
            edits.append(Edit(end, end, tail))
        return apply_edits(text, edits)

    def _after_imports(self) -> int:
        """Offset just after the module's leading imports."""
        last = None
        for stmt in self.source.tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                last = stmt
            elif isinstance(stmt, ast.Expr) and last is None:
                continue  # module docstring
            elif isinstance(
                stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                break
        if last is None:
            return 0
        return self.source.line_end(last.end_lineno)

    def _type_checking_block(self) -> ast.If | None:
        for stmt in self.source.tree.body:
            if (
                isinstance(stmt, ast.If)
                and ast.unparse(stmt.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                and not stmt.orelse
            ):
                return stmt
        return None


def _unique(lines: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for line in lines:
        seen.setdefault(line, None)
    return list(seen)
