"""The comparer of vLLM's own tests run with the overlay on and off
(tests_upstream/compare_outcomes.py, docs/upstream-tests.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    path = ROOT / "tests_upstream" / "compare_outcomes.py"
    spec = importlib.util.spec_from_file_location("compare_outcomes", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


co = _load()

ON_STATE = {"active": True, "reason": "active", "applied": ["x:y"]}
OFF_STATE = {"active": False, "reason": "switched off", "applied": []}


def _record(mode: str, outcomes: dict[str, str], state: dict | None = None) -> dict:
    state = state or (ON_STATE if mode == "on" else OFF_STATE)
    return {
        "overlay": mode,
        "activation_at_start": state,
        "activation_at_end": state,
        "duration_s": 1.0,
        "collection_errors": {},
        "tests": {
            nodeid: {"outcome": o, "needs_hub": False, "message": ""}
            for nodeid, o in outcomes.items()
        },
    }


def test_the_docs_table_parses_and_lists_only_known_outcomes():
    text = (ROOT / "docs" / "upstream-tests.md").read_text()
    rows = co.parse_deviations(text)
    # tests/v1/core has none: every model without state layers is planned by
    # upstream; the one listed is the full-graph cap instead of upstream's
    # refusal, in vLLM's tests/test_config.py
    assert [row.pattern for row in rows] == [
        "tests/test_config.py::"
        "test_resolve_cudagraph_mode_skips_mamba_block_check_while_profiling"
    ]
    for row in rows:
        assert (row.on, row.off) == ("failed", "passed")
        assert "exceeds available Mamba cache blocks" in row.reason
        assert "what users get instead" in row.reason.lower()


def test_not_run_rows_are_no_deviations():
    """The "Not run" table has two cells a row; the comparer must not read
    its rows as deviations."""
    text = (ROOT / "docs" / "upstream-tests.md").read_text()
    assert "| `tests/v1/test_oracle.py::*` | hub model |" in text
    assert all("test_oracle" not in r.pattern for r in co.parse_deviations(text))


def test_counts_are_kept_per_part():
    outcomes = {
        "tests/v1/core/test_a.py::x": "passed",
        "tests/v1/core/test_a.py::y": "failed",
        "tests/test_config.py::z": "passed",
    }
    record = _record("on", outcomes)
    core, selection = (co.counts(record, part) for _, part in co.PARTS)
    assert (core["collected"], core["passed"], core["failed"]) == (2, 1, 1)
    assert (selection["collected"], selection["passed"]) == (1, 1)
    assert co.counts(record)["collected"] == 3


def test_same_outcomes_pass_and_the_closing_line_counts_them():
    outcomes = {"t.py::a": "passed", "t.py::b": "failed"}
    report, ok = co.compare(_record("on", outcomes), _record("off", outcomes), [])
    assert ok
    assert report.splitlines()[-1] == "comparison: 2 passed, 0 failed"


def test_an_unlisted_difference_fails_and_a_listed_one_passes():
    on = _record("on", {"t.py::a[1]": "failed", "t.py::b": "passed"})
    off = _record("off", {"t.py::a[1]": "passed", "t.py::b": "passed"})
    report, ok = co.compare(on, off, [])
    assert not ok and "NOT LISTED" in report
    listed = co.parse_deviations("| `t.py::a[*]` | failed | passed | why |")
    report, ok = co.compare(on, off, listed)
    assert ok, report


def test_a_listed_test_with_other_outcomes_fails():
    on = _record("on", {"t.py::a": "error"})
    off = _record("off", {"t.py::a": "passed"})
    listed = co.parse_deviations("| `t.py::a` | failed | passed | why |")
    report, ok = co.compare(on, off, listed)
    assert not ok and "LISTED AS failed/passed" in report


def test_a_test_missing_from_one_run_fails():
    report, ok = co.compare(
        _record("on", {"t.py::a": "passed"}), _record("off", {}), []
    )
    assert not ok and "missing" in report


def test_an_on_run_without_the_overlay_fails():
    outcomes = {"t.py::a": "passed"}
    report, ok = co.compare(
        _record("on", outcomes, OFF_STATE), _record("off", outcomes), []
    )
    assert not ok and "overlay not active" in report


def test_unknown_outcomes_in_the_table_are_rejected():
    with pytest.raises(ValueError, match="unknown outcome"):
        co.parse_deviations("| `t.py::a` | broke | passed | why |")


FORK_STATE = {"active": False, "reason": "vllm-hybrid not installed", "applied": []}


def test_the_forks_rows_are_read_for_the_fork_only():
    text = (
        "| `tests/a.py::t` | failed | passed | why |\n\n"
        f"## {co.FORK_SECTION}\n\n"
        "| `tests/b.py::t` | passed | failed | why |\n"
    )
    assert [d.pattern for d in co.parse_deviations(text)] == ["tests/a.py::t"]
    assert [d.pattern for d in co.parse_deviations(text, fork=True)] == [
        "tests/b.py::t"
    ]


def test_a_fork_run_is_compared_with_the_overlay_on():
    on = _record("on", {"tests/x.py::t": "passed", "tests/y.py::t": "failed"})
    fork = _record(
        "fork",
        {"tests/x.py::t": "passed", "tests/y.py::t": "failed"},
        {**FORK_STATE, "fork": True},
    )
    report, ok = co.compare(on, fork, [])
    assert ok, report
    assert "same outcomes on/fork" in report
    fork["tests"]["tests/x.py::t"]["outcome"] = "failed"
    assert not co.compare(on, fork, [])[1]


def test_a_fork_run_without_the_forks_vllm_fails():
    on = _record("on", {"tests/x.py::t": "passed"})
    fork = _record("fork", {"tests/x.py::t": "passed"}, {**FORK_STATE, "fork": False})
    report, ok = co.compare(on, fork, [])
    assert not ok
    assert "no HybridKVConfig" in report
