"""Compare the per-test outcomes of vLLM's tests with the overlay on and off.

The tests are vLLM's ``tests/v1/core`` and the tests the patch registry
selects (``select_tests.py``), run in one pytest process per mode.

Reads the two records ``upstream_overlay`` writes (``--outcomes-json``) and
the deviations table of ``docs/upstream-tests.md``, prints the counts of both
runs and every test whose outcome differs, and exits non-zero when

* a test's outcome differs and the test is not listed as a deviation, or a
  listed deviation shows outcomes other than the ones listed;
* either run did not have the overlay state it asked for (start and end);
* a test ran in one mode only, or collection failed differently.

Deviation rows are markdown table rows whose first cell is a backquoted
pytest node id (``*`` matches any text) followed by the expected
outcome with the overlay on, then off, then the reason::

    | `tests/v1/core/test_x.py::test_y[*]` | failed | passed | why |

The same comparison runs between the overlay on and the fork
(``vllm-hybrid fork --wheel`` installed without vllm-hybrid, a record with
``--overlay=fork``); its deviations are the rows under the heading
:data:`FORK_SECTION`, which the on/off comparison leaves out.

Usage: python compare_outcomes.py ON.json OFF_OR_FORK.json DEVIATIONS.md
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(\w+)\s*\|\s*(\w+)\s*\|(.*)\|\s*$")


@dataclass(frozen=True)
class Deviation:
    pattern: str
    on: str
    off: str
    reason: str

    def matches(self, nodeid: str) -> bool:
        """Exact match; ``*`` matches any text (brackets are literal, as in
        parametrized ids)."""
        regex = ".*".join(re.escape(part) for part in self.pattern.split("*"))
        return re.fullmatch(regex, nodeid) is not None


#: Heading (``## ...``) of the rows that list the fork's deviations.
FORK_SECTION = "Deviations of the fork"


def parse_deviations(text: str, fork: bool = False) -> list[Deviation]:
    """The deviation rows of a markdown file (see the module docstring):
    those under :data:`FORK_SECTION` with ``fork``, the others without."""
    rows = []
    in_fork = False
    for line in text.splitlines():
        if line.startswith("## "):
            in_fork = line[3:].strip() == FORK_SECTION
        if in_fork != fork:
            continue
        m = _ROW.match(line.strip())
        if m and "::" in m.group(1):
            pattern, on, off, reason = m.groups()
            for outcome in (on, off):
                if outcome not in OUTCOMES:
                    raise ValueError(f"unknown outcome {outcome!r} in: {line}")
            rows.append(Deviation(pattern, on, off, reason.strip()))
    return rows


#: The parts of a run counted apart: vLLM's tests/v1/core, which runs whole,
#: and the tests selected by the patch registry (tests_upstream/select_tests.py).
PARTS = (
    ("tests/v1/core", lambda nodeid: nodeid.startswith("tests/v1/core/")),
    ("registry selection", lambda nodeid: not nodeid.startswith("tests/v1/core/")),
)


def counts(record: dict, part=None) -> dict[str, int]:
    """Outcome counts of a run, or of the tests of one of :data:`PARTS`."""
    tests = {k: v for k, v in record["tests"].items() if part is None or part(k)}
    c = Counter(t["outcome"] for t in tests.values())
    out = {"collected": len(tests)}
    out.update({o: c.get(o, 0) for o in OUTCOMES})
    out["needing hub models"] = sum(t["needs_hub"] for t in tests.values())
    if part is None:
        out["collection errors"] = len(record.get("collection_errors", {}))
    return out


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )


def _overlay_problems(mode: str, record: dict) -> list[str]:
    problems = []
    want_on = mode == "on"
    if mode == "fork" and not record["activation_at_start"].get("fork"):
        problems.append("fork run: vLLM there has no HybridKVConfig")
    if record.get("overlay") != mode:
        problems.append(
            f"{mode} run was started with --overlay={record.get('overlay')}"
        )
    for when in ("activation_at_start", "activation_at_end"):
        act = record[when]
        if act["active"] != want_on or bool(act["applied"]) != want_on:
            problems.append(
                f"{mode} run: overlay {'not ' if want_on else ''}active at "
                f"{when.rsplit('_', 1)[1]} ({act['reason']}, "
                f"{len(act['applied'])} patches applied)"
            )
    return problems


def compare(on: dict, off: dict, deviations: list[Deviation]) -> tuple[str, bool]:
    """The report text and whether the comparison passed."""
    lines: list[str] = []
    other = off.get("overlay") or "off"
    problems = _overlay_problems("on", on) + _overlay_problems(other, off)

    c_on, c_off = counts(on), counts(off)
    rows = [("", "overlay on", "fork" if other == "fork" else "overlay off")]
    rows += [(k, str(c_on[k]), str(c_off[k])) for k in c_on]
    rows.append(("duration (s)", str(on["duration_s"]), str(off["duration_s"])))
    lines += ["Outcomes of vLLM's tests:", _table(rows), ""]
    for name, part in PARTS:
        p_on, p_off = counts(on, part), counts(off, part)
        rows = [(f"  {name}", "on", other)]
        rows += [
            (f"  {k}", str(p_on[k]), str(p_off[k])) for k in p_on if p_on[k] or p_off[k]
        ]
        lines += [_table(rows), ""]

    restored = on.get("overlay_restored_after", {})
    if restored:
        lines.append(
            "Tests that reloaded a patched module (overlay re-applied after each):"
        )
        lines += [f"  {nodeid}" for nodeid in restored]
        lines.append("")

    if on.get("collection_errors") != off.get("collection_errors"):
        problems.append(
            "collection errors differ: "
            f"on={on.get('collection_errors')} off={off.get('collection_errors')}"
        )

    t_on, t_off = on["tests"], off["tests"]
    differing: list[tuple[str, ...]] = []
    listed_seen: set[str] = set()
    all_ids = sorted(set(t_on) | set(t_off))
    bad = 0
    for nodeid in all_ids:
        a = t_on.get(nodeid, {}).get("outcome", "missing")
        b = t_off.get(nodeid, {}).get("outcome", "missing")
        if a == b:
            continue
        dev = next((d for d in deviations if d.matches(nodeid)), None)
        if dev is None:
            verdict = "NOT LISTED"
            bad += 1
        elif (dev.on, dev.off) != (a, b):
            verdict = f"LISTED AS {dev.on}/{dev.off}"
            bad += 1
        else:
            verdict = "listed"
            listed_seen.add(dev.pattern)
        message = (
            (t_on if a not in ("passed", "missing") else t_off)
            .get(nodeid, {})
            .get("message", "")
        )
        differing.append((nodeid, a, b, verdict, message[:100]))

    if differing:
        lines.append(f"Tests whose outcome differs ({len(differing)}):")
        lines.append(
            _table(
                [("node id", "on", "off", "deviations table", "message")] + differing
            )
        )
    else:
        lines.append(
            f"Every test has the same outcome with the overlay on and {other}."
        )
    stale = [d.pattern for d in deviations if d.pattern not in listed_seen]
    if stale:
        lines.append("")
        lines.append("Listed deviations that did not differ in this run (stale rows?):")
        lines += [f"  {p}" for p in stale]
    if problems:
        lines.append("")
        lines += [f"ERROR: {p}" for p in problems]
    ok = not bad and not problems
    lines.append("")
    lines.append(
        f"upstream tests: same outcomes on/{other} apart from listed deviations"
        if ok
        else "upstream tests: FAILED (see above; deviations belong in "
        "docs/upstream-tests.md with a reason)"
    )
    # One comparison per test; the overlay-state checks count as failed ones.
    failed = bad + len(problems)
    lines.append(f"comparison: {len(all_ids) - bad} passed, {failed} failed")
    return "\n".join(lines), ok


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    on = json.loads(Path(argv[0]).read_text())
    off = json.loads(Path(argv[1]).read_text())
    fork = off.get("overlay") == "fork"
    deviations = parse_deviations(Path(argv[2]).read_text(), fork=fork)
    report, ok = compare(on, off, deviations)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
