"""The patch registry against what is installed.

Every entry must be documented, must name every module of the installed vLLM
that binds the target by name, and must be the only way patches get applied:
after activation every listed binding holds the overlay's object, after
reverting (or with the switch off, or on another vLLM version) upstream's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm

from vllm_hybrid import plugin
from vllm_hybrid.patches.registry import (
    PATCHES,
    SUBCLASSES,
    PatchEntry,
    SubclassEntry,
    load_object,
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
        assert entry.issue > 0, entry.target
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
    assert entry.upstream_status.startswith("none") and entry.issue > 0
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
