"""Rules the test suite keeps so that a green run stays green on any machine.

- No wall-clock reads in tests: how long something took depends on the
  machine and its load, so a bound on it belongs in ``benchmarks/``. Tests
  may pass timeouts to calls that could hang (a guard, not an assertion).
- Property tests take examples, seeds and health checks from the hypothesis
  profile (tests/conftest.py), not from per-test settings, so the CI profile
  stays deterministic and the fuzz profile can scale every test at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: Calls that read a clock whose value depends on machine speed and load.
CLOCK_READS = {
    ("time", "time"),
    ("time", "perf_counter"),
    ("time", "perf_counter_ns"),
    ("time", "monotonic"),
    ("time", "monotonic_ns"),
    ("time", "process_time"),
    ("timeit", "timeit"),
    ("timeit", "default_timer"),
}

#: hypothesis settings that belong to the profile only.
PROFILE_SETTINGS = {"max_examples", "derandomize", "database", "deadline"}


def _sources() -> list[tuple[Path, ast.Module]]:
    return [
        (path, ast.parse(path.read_text(), filename=str(path)))
        for path in sorted(TESTS.rglob("*.py"))
    ]


def _attribute_calls(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                yield node, (func.value.id, func.attr)
            elif isinstance(func, ast.Name):
                yield node, (None, func.id)


def clock_reads(tree: ast.Module) -> list[int]:
    """Lines that call a clock, directly or through a name imported from
    the time/timeit modules."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "timeit")
        for alias in node.names
        if (node.module, alias.name) in CLOCK_READS
    }
    return [
        node.lineno
        for node, (owner, name) in _attribute_calls(tree)
        if (owner, name) in CLOCK_READS or (owner is None and name in imported)
    ]


def profile_overrides(tree: ast.Module) -> list[int]:
    """Lines that set a profile-owned option in a hypothesis ``settings(...)``
    call outside the profile registrations."""
    return [
        node.lineno
        for node, (owner, name) in _attribute_calls(tree)
        if name == "settings" and owner in (None, "hypothesis")
        for kw in node.keywords
        if kw.arg in PROFILE_SETTINGS
    ]


def test_no_test_reads_a_wall_clock():
    found = {
        str(path.relative_to(TESTS)): lines
        for path, tree in _sources()
        if path != Path(__file__).resolve()
        for lines in [clock_reads(tree)]
        if lines
    }
    assert found == {}, "time bounds belong in benchmarks/, not in tests"


def test_property_tests_take_their_budget_from_the_profile():
    found = {
        str(path.relative_to(TESTS)): lines
        for path, tree in _sources()
        if path.name != "conftest.py"
        for lines in [profile_overrides(tree)]
        if lines
    }
    assert found == {}


def test_the_rules_catch_what_they_name():
    bad = ast.parse(
        "import time\n"
        "from time import perf_counter as pc\n"
        "from hypothesis import settings\n"
        "t = time.monotonic()\n"
        "u = pc()\n"
        "settings(max_examples=5, stateful_step_count=3)\n"
        "settings(stateful_step_count=3)\n"
    )
    assert clock_reads(bad) == [4, 5]
    assert profile_overrides(bad) == [6]


def test_processes_the_suite_starts_collect_young_generations_only():
    """tests/site/sitecustomize.py reaches this process and the processes a
    test starts (through PYTHONPATH): an explicit gc.collect() leaves a cycle
    that survived into the oldest generation, full_collect() frees it."""
    import subprocess
    import sys

    probe = (
        "import gc, weakref\n"
        "from sitecustomize import full_collect\n"
        "class Node: pass\n"
        "a = Node(); a.self = a; alive = weakref.ref(a)\n"
        "full_collect()\n"  # a, still referenced, is in the oldest generation
        "del a; gc.collect()\n"
        "after_young = alive() is not None\n"
        "full_collect()\n"
        "print(gc.collect.__module__, after_young, alive() is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["sitecustomize", "True", "True"]
