"""One request's allocation goes down the layers and back, checked from the source.

Admission returns what it reserved and the allocation consumes it
(``PooledCoordinatorMixin``'s ``Reservation``); the pools never call up into
the boundary, the arena or the coordinator, and no module keeps a one-shot
field that hands a block from one call to the next ("the next allocation
returns this block"). ``tests/test_layering.py`` checks imports and reach in
general, but it lets a lower module name a higher one's method through a
``Protocol`` it declares itself; this test does not, because a call up
through an interface is still a call up.
"""

from __future__ import annotations

import ast

from import_graph import PACKAGE
from test_layering import POOLED_LAYERS, ambient_names, defined_names

POOLED_DIR = PACKAGE / "v1" / "core" / "pooled"
#: The pool layer: every pooled module below the coupling.
POOL_MODULES = POOLED_LAYERS[: POOLED_LAYERS.index("coupling")]
#: The layers a pool must never call back.
ABOVE_POOLS = ("coupling", "boundary", "arena", "coordinator")

#: Calls up that remain, with why; the test fails when one is gone, so the
#: list only shrinks. None remain: the pools record their prefix-cache events
#: as values and the coupling handles them after each operation (see
#: ``coupling.PoolHandle``).
ALLOWED_CALLS_UP: set[tuple[str, str]] = set()


def _tree(module: str) -> ast.Module:
    """The source of a pooled module named as in ``POOLED_LAYERS`` (dotted
    for a subpackage's modules, a package by its ``__init__``)."""
    path = POOLED_DIR.joinpath(*module.split("."))
    if path.is_dir():
        return ast.parse((path / "__init__.py").read_text())
    return ast.parse(path.with_suffix(".py").read_text())


def _protocol_names(tree: ast.Module) -> set[str]:
    """Methods of the ``Protocol`` classes a module declares (interfaces it
    calls through, not behaviour it has)."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if any(ast.unparse(base) == "Protocol" for base in cls.bases):
            names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return names


def calls_up(modules: dict[str, ast.Module], above: dict[str, ast.Module]):
    """``(module, method)`` of each call a module of ``modules`` makes on an
    object other than ``self``/``super()`` to a method only ``above``
    defines (a ``Protocol`` stub of the caller's own does not count as its
    own: the call still lands above)."""
    own: set[str] = set()
    for tree in modules.values():
        own |= defined_names(tree) - _protocol_names(tree)
    upward = set().union(*(defined_names(t) for t in above.values()))
    upward -= own | ambient_names()
    found = set()
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            ):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            if node.func.attr in upward:
                found.add((name, node.func.attr))
    return found


def _self_attribute(node: ast.AST, ctx: type[ast.expr_context]) -> str | None:
    """``name`` when ``node`` is ``self.name`` read (``ast.Load``) or written
    (``ast.Store``) as ``ctx`` says; None otherwise."""
    if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ctx):
        return None
    owner = node.value
    return node.attr if isinstance(owner, ast.Name) and owner.id == "self" else None


def one_shot_fields(tree: ast.Module) -> set[str]:
    """``self`` attributes a function reads and clears in one go (``x,
    self.f = self.f, None``) or reads and then sets to None: a value left
    for the next call to pick up."""
    found = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        read = {_self_attribute(node, ast.Load) for node in ast.walk(fn)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            values = (
                node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            )
            if not any(isinstance(v, ast.Constant) and v.value is None for v in values):
                continue
            for target in node.targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    name = _self_attribute(t, ast.Store)
                    if name is not None and name in read:
                        found.add(name)
    return found


def test_no_pool_calls_the_boundary_arena_coordinator_or_coupling():
    pools = {m: _tree(m) for m in POOL_MODULES}
    above = {m: _tree(m) for m in ABOVE_POOLS}
    assert calls_up(pools, above) == ALLOWED_CALLS_UP


def test_no_module_keeps_a_one_shot_field():
    found = {
        (path.stem, field)
        for path in sorted((PACKAGE / "v1" / "core").rglob("*.py"))
        for field in one_shot_fields(ast.parse(path.read_text()))
    }
    assert found == set()


#: Lifecycle methods that drop what an object kept about one request or
#: block, when it ends or moves: a pop there ends a record, it hands nothing
#: to another call.
LIFECYCLE = frozenset({"__init__", "free", "pop_blocks_for_free", "forget", "rekey"})

#: The hand-offs that remain, with why each is not a value left for another
#: call to pick up; the test fails when one is gone, so the list only shrinks.
ALLOWED_HANDOFFS: dict[tuple[str, str], str] = {
    ("moves", "reset TokenMoves._known_as"): (
        "the step's moves are collected during its allocations and handed to "
        "the workers once per step (take), as upstream collects the new block "
        "ids it zeroes"
    ),
    ("moves", "reset TokenMoves.pending"): "the same collection (take)",
    ("moves", "pop TokenMoves._known_as"): (
        "moves of one block within a step compose into one (record)"
    ),
    ("scheduler", "setattr output"): (
        "the step's moves travel to the workers on the SchedulerOutput "
        "(registry: ADDED_ATTRIBUTES)"
    ),
    ("turn_ends", "setattr kv_cache_config"): (
        "hybrid_kv.retain_turn_ends on a single-pool plan, for the factory "
        "that builds its coordinator (registry: ADDED_ATTRIBUTES)"
    ),
    ("coupling", "setattr self.pool"): (
        "a pool's handle sets what is set on it on the pool it stands for"
    ),
}


def handoffs(name: str, tree: ast.Module) -> set[tuple[str, str]]:
    """Where a module hands a value from one call to another instead of
    returning it: a field reset to an empty container outside the
    constructor, a popped value used outside a lifecycle method, ``setattr``
    on another object, a ``hasattr`` check (an attribute pushed where it may
    be missing)."""
    found: set[tuple[str, str]] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            found |= _handoffs_in(cls.name, fn)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr":
                found.add((name, f"hasattr {ast.unparse(node.args[0])}"))
            elif node.func.id == "setattr":
                found.add((name, f"setattr {ast.unparse(node.args[0])}"))
    return {(name, what) for _, what in found}


def _handoffs_in(cls: str, fn: ast.FunctionDef) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    empty = (ast.Dict, ast.List, ast.Set)
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and fn.name != "__init__":
            values = (
                node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            )
            targets = [
                t
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
            for t, v in zip(targets, values * len(targets), strict=False):
                field = _self_attribute(t, ast.Store)
                if field and isinstance(v, empty) and not getattr(v, "elts", v.keys):
                    found.add((cls, f"reset {cls}.{field}"))
        if fn.name in LIFECYCLE or not isinstance(node, ast.Assign):
            continue
        call = node.value
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "pop"
            and _self_attribute(call.func.value, ast.Load)
        ):
            found.add((cls, f"pop {cls}.{call.func.value.attr}"))
    return found


def test_no_module_hands_values_between_calls():
    """Admission returns what allocation consumes; nothing in ``v1/core`` is
    left in a field, pushed onto another object or popped by a later call,
    but the hand-offs listed (with why) in :data:`ALLOWED_HANDOFFS`."""
    found = set()
    for path in sorted((PACKAGE / "v1" / "core").rglob("*.py")):
        found |= handoffs(path.stem, ast.parse(path.read_text()))
    assert found - set(ALLOWED_HANDOFFS) == set()
    assert set(ALLOWED_HANDOFFS) - found == set(), "a listed hand-off is gone"


def test_the_handoff_check_catches_each_pattern():
    """The shapes the widened check exists for, each caught: a reservation
    popped by the next call, a per-call scratch dict, a value pushed onto
    another object through ``hasattr``, ``setattr`` of a step's result."""
    tree = ast.parse(
        "class Coordinator:\n"
        "    def count(self, rid):\n"
        "        self._reserved[rid] = 1\n"
        "    def allocate(self, rid):\n"
        "        reserved = self._reserved.pop(rid, None)\n"
        "    def schedule(self):\n"
        "        self._room = {}\n"
        "        if hasattr(coordinator, 'reserve'):\n"
        "            coordinator.reserve = 3\n"
        "        setattr(output, 'moves', {})\n"
        "    def free(self, rid):\n"
        "        self._reserved.pop(rid, None)\n"
    )
    assert handoffs("m", tree) == {
        ("m", "pop Coordinator._reserved"),
        ("m", "reset Coordinator._room"),
        ("m", "hasattr coordinator"),
        ("m", "setattr output"),
    }


def test_the_checks_catch_what_they_name():
    """Both checks flag the shapes they exist for: a pool asking the boundary
    for room through its own Protocol, and a lent block picked up by the
    next allocation."""
    pool = ast.parse(
        "from typing import Protocol\n"
        "class Growth(Protocol):\n"
        "    def ensure(self, need): ...\n"
        "class Pool:\n"
        "    def get_new_blocks(self, n):\n"
        "        lent, self._lent = self._lent, None\n"
        "        self.growth.ensure(n)\n"
        "    def take(self):\n"
        "        block = self._next\n"
        "        self._next = None\n"
        "        return block\n"
    )
    boundary = ast.parse("class Boundary:\n    def ensure(self, need): ...\n")
    assert calls_up({"pool": pool}, {"boundary": boundary}) == {("pool", "ensure")}
    assert one_shot_fields(pool) == {"_lent", "_next"}
