"""The patch registry against what is installed.

Every entry must be documented, must name every module of the installed vLLM
that binds the target by name, and must be the only way patches get applied:
after activation every listed binding holds the overlay's object, after
reverting (or with the switch off, or on another vLLM version) upstream's.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import vllm
from private_access import is_private, private_upstream_uses

from vllm_hybrid import plugin
from vllm_hybrid.patches.entry import PrivateAttribute, SubclassEntry
from vllm_hybrid.patches.registry import (
    ADDED_ATTRIBUTES,
    ADDED_SYMBOLS,
    CLI_PATCHES,
    INSTANCE_REWRITES,
    PATCHES,
    PRIVATE_ATTRIBUTES,
    SUBCLASSES,
    PatchEntry,
    applied,
    apply_all,
    load_object,
    revert_all,
    upstream,
)

PROBE = Path(__file__).with_name("probe_bindings.py")
VLLM_ROOT = Path(vllm.__file__).parent


def _places(entry: PatchEntry) -> dict[str, object]:
    places = {"<home>": load_object(entry.target)}
    for module_name in entry.bindings:
        module = importlib.import_module(module_name)
        places[module_name] = getattr(module, entry.name)
    return places


def _module_level_imports(tree: ast.Module):
    """ImportFrom nodes executed at import time (not under TYPE_CHECKING)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" not in test:
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body)
            for handler in node.handlers:
                stack.extend(handler.body)
            stack.extend(node.orelse)
            stack.extend(node.finalbody)


def _by_name_bindings(home: str, name: str) -> set[str]:
    """Modules of the installed vLLM that do ``from home import name``."""
    found = set()
    for path in VLLM_ROOT.rglob("*.py"):
        text = path.read_text(errors="replace")
        if name not in text:
            continue
        rel = path.relative_to(VLLM_ROOT.parent).with_suffix("")
        module_name = ".".join(rel.parts).removesuffix(".__init__")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in _module_level_imports(tree):
            if node.module == home and any(a.name == name for a in node.names):
                found.add(module_name)
    return found


def test_registry_is_not_empty_and_documented():
    assert len(PATCHES) >= 1
    targets = [entry.target for entry in PATCHES]
    assert len(targets) == len(set(targets)), "a target is listed twice"
    for entry in PATCHES:
        for field in ("why", "how", "removal"):
            assert len(getattr(entry, field).strip()) >= 10, (entry.target, field)
        status = entry.upstream_status
        assert status.startswith("none") or "github.com/vllm-project" in status, (
            entry.target
        )
        assert entry.target.startswith("vllm."), entry.target
        assert entry.replacement.startswith("vllm_hybrid."), entry.replacement
        assert upstream(entry.target) is not load_object(entry.replacement)


@pytest.mark.parametrize("entry", PATCHES, ids=lambda e: e.target)
def test_bindings_list_every_by_name_import(entry: PatchEntry):
    if "." in entry.attr_path:
        pytest.skip("class attribute: looked up through the class, no bindings")
    expected = _by_name_bindings(entry.home_module, entry.name)
    assert set(entry.bindings) == expected


def test_activation_binds_overlay_objects_and_revert_restores_upstream():
    plugin.register()
    try:
        for entry in PATCHES:
            replacement = load_object(entry.replacement)
            for where, obj in _places(entry).items():
                assert obj is replacement, (entry.target, where)
        plugin.deactivate()
        for entry in PATCHES:
            original = upstream(entry.target)
            for where, obj in _places(entry).items():
                assert obj is original, (entry.target, where)
                assert obj is not load_object(entry.replacement)
    finally:
        plugin.register()


def _probe(*args: str, switch: str | None) -> tuple[dict, str]:
    env = dict(os.environ)
    env.pop("VLLM_HYBRID_KV", None)
    if switch is not None:
        env["VLLM_HYBRID_KV"] = switch
    proc = subprocess.run(
        [sys.executable, str(PROBE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE ")), proc.stdout + proc.stderr


def _all_places(report: dict) -> set[str]:
    return {state for places in report["entries"].values() for state in places.values()}


def test_fresh_process_with_overlay_on_binds_overlay():
    report, log = _probe(switch=None)
    assert report["active"] is True
    assert len(report["entries"]) == len(PATCHES)
    assert _all_places(report) == {"overlay"}
    assert log.count("vllm-hybrid") == 1 and "active on vLLM 0.32.0" in log


def test_switch_off_keeps_every_binding_upstream():
    report, log = _probe(switch="0")
    assert report["active"] is False
    assert len(report["entries"]) == len(PATCHES)
    assert _all_places(report) == {"upstream"}
    assert "VLLM_HYBRID_KV=0" in log and "unmodified" in log


def test_other_vllm_version_applies_nothing_and_warns():
    report, log = _probe("0.33.0", switch=None)
    assert report["active"] is False
    assert _all_places(report) == {"upstream"}
    warnings = [ln for ln in log.splitlines() if "WARNING" in ln and "0.32.0" in ln]
    assert len(warnings) == 1, log[-3000:]
    assert "found vLLM 0.33.0" in warnings[0]


@pytest.mark.parametrize("entry", SUBCLASSES, ids=lambda e: e.subclass)
def test_subclass_overrides_match_installed_upstream(entry: SubclassEntry):
    """Each listed override still overrides an upstream method of the same
    parameters, and no other upstream method is overridden unlisted."""
    base, sub = load_object(entry.base), load_object(entry.subclass)
    assert issubclass(sub, base)
    for field in ("why", "how", "removal"):
        assert len(getattr(entry, field).strip()) >= 10, (entry.subclass, field)
    assert entry.upstream_status.startswith("none")
    own = {
        name
        for klass in sub.__mro__[: sub.__mro__.index(base)]
        for name, value in vars(klass).items()
        if callable(value) and hasattr(base, name) and not name.startswith("__")
    }
    assert own == set(entry.overrides)
    for name in entry.overrides:
        theirs = inspect.signature(getattr(base, name)).parameters
        ours = inspect.signature(getattr(sub, name)).parameters
        kinds = {p.kind for p in ours.values()}
        if inspect.Parameter.VAR_POSITIONAL in kinds:
            continue  # forwards everything to upstream's method
        assert list(ours) == list(theirs), (name, list(ours), list(theirs))


PACKAGE = Path(__file__).resolve().parents[2] / "vllm_hybrid"
#: The modules that write patch targets (the registry's entries).
#: the registry's entry lists: entries.py and the *_entries.py it includes
REGISTRY_FILES = tuple(sorted((PACKAGE / "patches").glob("*entries.py")))


def _string_constants(path: Path) -> list[str]:
    """String constants of a module's code (docstrings, which may name a
    function in prose, excluded)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_targets_are_written_only_in_the_registry():
    """A target path (or its ``module.attr`` spelling) in any other module of
    the package would be a second source of truth for it."""
    spellings = {
        spelling: entry.target
        for entry in (*PATCHES, *CLI_PATCHES)
        for spelling in (entry.target, entry.target.replace(":", "."))
    }
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in REGISTRY_FILES:
            continue
        for text in _string_constants(path):
            found += [
                (str(path.relative_to(PACKAGE)), target)
                for spelling, target in spellings.items()
                if spelling in text
            ]
    assert found == []


def test_target_check_sees_a_constant_outside_the_registry(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(f"TARGET = {PATCHES[0].target!r}\n")
    assert PATCHES[0].target in _string_constants(source)


def test_cli_patch_is_documented_and_resolves():
    (entry,) = CLI_PATCHES
    for field in ("why", "how", "removal"):
        assert len(getattr(entry, field).strip()) >= 10
    assert load_object(entry.target) is not load_object(entry.replacement)


def _has_private_attribute(entry: PrivateAttribute, module_source=None) -> bool:
    """Whether the installed vLLM still has it: as a module or class
    attribute, or as ``self.<name> =`` in the class's own source."""
    owner = load_object(entry.owner) if ":" in entry.owner else None
    if owner is None:
        return hasattr(importlib.import_module(entry.owner), entry.name)
    if hasattr(owner, entry.name):
        return True
    for klass in owner.__mro__:
        if klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == entry.name
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return True
    return False


@pytest.mark.parametrize(
    "entry", PRIVATE_ATTRIBUTES, ids=lambda e: f"{e.owner}.{e.name}"
)
def test_private_upstream_attributes_still_exist(entry: PrivateAttribute):
    assert entry.name.startswith("_") and entry.where
    assert _has_private_attribute(entry), f"{entry.owner}.{entry.name} is gone"


def test_private_attribute_check_fails_for_a_missing_one():
    gone = PrivateAttribute(
        "vllm.v1.core.block_pool:BlockHashToBlockMap", "_no_such_cache", "test"
    )
    assert not _has_private_attribute(gone)
    gone = PrivateAttribute("vllm.v1.core.kv_cache_utils", "_no_such", "test")
    assert not _has_private_attribute(gone)


def _registered_private_names() -> set[str]:
    """Private upstream names the registry accounts for: listed private
    attributes, and replaced, overridden, added or re-pointed attributes."""
    names = {entry.name for entry in PRIVATE_ATTRIBUTES}
    names |= {entry.name for entry in (*PATCHES, *CLI_PATCHES)}
    names |= {name for entry in SUBCLASSES for name in entry.overrides}
    names |= {entry.name for entry in ADDED_ATTRIBUTES}
    names |= {name for entry in INSTANCE_REWRITES for name in entry.attributes}
    return {name for name in names if is_private(name)}


def _scanned_files(*extra: Path) -> list[Path]:
    trees = (PACKAGE, PACKAGE.parent / "benchmarks")
    return [path for tree in trees for path in tree.rglob("*.py")] + list(extra)


def test_private_upstream_uses_are_registered():
    """Every private upstream name that vllm_hybrid/ or benchmarks/ use (found
    by AST, not from a list) is in the registry, and every listed private
    attribute is still used somewhere (no stale entries)."""
    used = private_upstream_uses(_scanned_files())
    registered = _registered_private_names()
    unregistered = {
        name: sites for name, sites in used.items() if name not in registered
    }
    assert unregistered == {}
    listed = {entry.name for entry in PRIVATE_ATTRIBUTES}
    assert listed - set(used) == set()


def test_a_planted_private_access_in_benchmarks_is_found(tmp_path):
    planted = tmp_path / "benchmarks_probe.py"
    planted.write_text(
        "def peek(engine):\n"
        "    return engine.scheduler._planted_upstream_private\n"
        "\n"
        "def poke(pool):\n"
        "    return getattr(pool, '_another_planted_one')\n"
    )
    used = private_upstream_uses(_scanned_files(planted))
    registered = _registered_private_names()
    unregistered = {name for name in used if name not in registered}
    assert unregistered == {"_planted_upstream_private", "_another_planted_one"}
    assert used["_planted_upstream_private"] == [f"{planted}:2"]


def _known_to_upstream(cls_path: str, name: str) -> bool:
    """A field, class attribute or ``self.name =`` of the upstream class."""
    fields = getattr(load_object(cls_path), "__dataclass_fields__", {})
    probe = PrivateAttribute(cls_path, name, "registry test")
    return name in fields or _has_private_attribute(probe)


@pytest.mark.parametrize("entry", ADDED_ATTRIBUTES, ids=lambda e: e.name)
def test_added_attributes_are_unknown_to_upstream(entry):
    """An attribute the overlay adds must not exist on the upstream class:
    upstream adding the same name would collide with it."""
    assert not _known_to_upstream(entry.cls, entry.name)


def test_added_attribute_check_sees_upstream_fields():
    config = "vllm.v1.kv_cache_interface:KVCacheConfig"
    assert _known_to_upstream(config, "num_blocks")
    assert _known_to_upstream(config, "kv_tp_replicas")
    assert not _known_to_upstream(config, "retain_turn_ends")


@pytest.mark.parametrize("entry", INSTANCE_REWRITES, ids=lambda e: e.cls)
def test_instance_rewrites_name_attributes_upstream_sets(entry):
    for name in entry.attributes:
        probe = PrivateAttribute(entry.cls, name, entry.where)
        assert _has_private_attribute(probe), f"{entry.cls} no longer sets {name}"


@pytest.mark.parametrize("entry", ADDED_ATTRIBUTES, ids=lambda e: e.name)
def test_added_attribute_types_resolve_in_the_class_module(entry):
    """The declared type (what the attribute becomes in the fork) names only
    what the upstream class's module has."""
    module = importlib.import_module(entry.cls.split(":")[0])
    namespace = {**vars(module)}
    eval(entry.annotation, namespace)  # noqa: S307 - registry text
    eval(entry.default, namespace)  # noqa: S307


def _module_source_names(module_name: str) -> set[str]:
    """Top-level names the installed module's source defines or imports."""
    spec = importlib.util.find_spec(module_name)
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("symbol", ADDED_SYMBOLS, ids=lambda s: s.target)
def test_added_symbols_are_new_to_upstream_and_bound_while_active(symbol):
    assert symbol.name not in _module_source_names(symbol.home_module)
    module = importlib.import_module(symbol.home_module)
    already_applied = bool(applied())
    apply_all()
    try:
        assert getattr(module, symbol.name) is load_object(symbol.source)
    finally:
        if not already_applied:
            revert_all()
    if not already_applied:
        assert not hasattr(module, symbol.name)
