"""Find private upstream attributes a source tree touches, by AST.

A private name (``_name``, not a dunder) that the tree uses but never
defines is upstream's: the registry must list it
(:data:`vllm_hybrid.patches.subclasses.PRIVATE_ATTRIBUTES`, or a patch
target of :mod:`vllm_hybrid.patches.entries`). Uses that count:

* attribute reads and writes (``x._name``);
* ``from vllm... import _name``;
* ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with a literal name;
* keys of a class body built on the fly (``type(name, bases, {"_name": ...})``)
  and ``X.__dict__["_name"]``.

Names the tree defines itself (functions, classes, ``self._name =``,
module-level ``_name =``, arguments) are its own and are not reported; a
private name both sides define is not told apart (the overlay then owns a
twin of it, which the subclass entries list).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

_NAME_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {name for name in names if is_private(name)}


def _literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _used(tree: ast.AST) -> Iterable[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "vllm"
        ):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in _NAME_CALLS and len(node.args) >= 2:
                name = _literal(node.args[1])
                if name is not None:
                    yield name, node.lineno
            elif node.func.id == "type" and len(node.args) == 3:
                body = node.args[2]
                if isinstance(body, ast.Dict):
                    for key in body.keys:
                        name = _literal(key) if key is not None else None
                        if name is not None:
                            yield name, node.lineno
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "__dict__"
        ):
            name = _literal(node.slice)
            if name is not None:
                yield name, node.lineno


def private_upstream_uses(paths: Iterable[Path]) -> dict[str, list[str]]:
    """``{private name: ["file:line", ...]}`` for every private name the
    files use and none of them defines."""
    trees = {path: ast.parse(path.read_text()) for path in paths}
    own: set[str] = set()
    for tree in trees.values():
        own |= _defined(tree)
    found: dict[str, list[str]] = {}
    for path, tree in trees.items():
        for name, line in _used(tree):
            if is_private(name) and name not in own:
                found.setdefault(name, []).append(f"{path}:{line}")
    return found
