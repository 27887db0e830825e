"""Select vLLM's own tests by what the patch registry replaces.

For every entry of :data:`vllm_hybrid.patches.entries.PATCHES`, the test
functions of vLLM's ``tests/`` tree that touch the replaced symbol, found by
reading the code (``scan_tests.py`` has the rule), not from a hand-kept
list. The selection is written to ``selection.json`` next to this file and
committed; ``tests/test_upstream_selection.py`` checks it against the
registry and, once vLLM's tests are fetched, against a fresh scan, so a new
entry brings its tests along. ``scripts/upstream_tests.sh`` runs the
selected tests outside ``tests/v1/core`` (which runs whole) next to it,
apart from the rows of the "Not run" table of ``docs/upstream-tests.md``
(tests that need a GPU, a hub model, a missing package or minutes).

Usage::

    python select_tests.py write SRC    # scan SRC/tests, rewrite selection.json
    python select_tests.py check SRC    # fail if selection.json is stale
    python select_tests.py run-list DOC # print the node ids to run

``SRC`` is the extracted vLLM source tree (``.upstream-tests/vllm-X.Y.Z``);
``DOC`` is ``docs/upstream-tests.md``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from scan_tests import scan

SELECTION = Path(__file__).with_name("selection.json")

#: The part of vLLM's tests that runs whole, whatever the selection says.
ALWAYS_RUN = "tests/v1/core/"

_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


# ---------------------------------------------------------------------------
# The committed selection, the "Not run" table, the run list
# ---------------------------------------------------------------------------


def registry_targets() -> list[str]:
    """The targets whose tests are selected: the plugin's entries. The
    command-line entries (CLI_PATCHES) are applied by the ``vllm-hybrid``
    command only, never in a test process, so no run could tell on from off."""
    from vllm_hybrid.patches.entries import PATCHES

    return [entry.target for entry in PATCHES]


def _vllm_root() -> Path:
    """The installed vLLM package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return Path(next(iter(spec.submodule_search_locations)))


def load(path: Path = SELECTION) -> dict:
    return json.loads(path.read_text())


def render(vllm_version: str, entries: dict[str, list[str]]) -> str:
    record = {"vllm": vllm_version, "entries": entries}
    return json.dumps(record, indent=1) + "\n"


def section(text: str, heading: str) -> list[str]:
    """The lines under the markdown heading ``heading`` (up to the next
    heading of the same or a higher level)."""
    level = heading.split(" ", 1)[0]
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("#"):
            this = line.split(" ", 1)[0]
            if inside and len(this) <= len(level):
                break
            if line.strip() == heading:
                inside = True
                continue
        if inside:
            lines.append(line)
    return lines


@dataclass(frozen=True)
class NotRun:
    """A row of the "Not run" table: node ids matching ``pattern`` (``*``
    matches any text) are selected but not run, for ``reason``."""

    pattern: str
    reason: str

    def matches(self, nodeid: str) -> bool:
        regex = ".*".join(re.escape(part) for part in self.pattern.split("*"))
        return re.fullmatch(regex, nodeid) is not None


NOT_RUN_HEADING = "## Not run"


def parse_not_run(text: str) -> list[NotRun]:
    rows = []
    for line in section(text, NOT_RUN_HEADING):
        m = _ROW.match(line.strip())
        if m:
            rows.append(NotRun(m.group(1), m.group(2).strip(" |")))
    return rows


def run_list(selection: dict, not_run: list[NotRun]) -> list[str]:
    """The selected node ids outside ``tests/v1/core`` (which runs whole)
    and outside the "Not run" table, sorted, each once."""
    nodes = {n for ids in selection["entries"].values() for n in ids}
    return sorted(
        n
        for n in nodes
        if not n.startswith(ALWAYS_RUN) and not any(r.matches(n) for r in not_run)
    )


def stale_rows(selection: dict, not_run: list[NotRun]) -> list[str]:
    """Patterns of the "Not run" table that match no selected test."""
    nodes = {n for ids in selection["entries"].values() for n in ids}
    return [r.pattern for r in not_run if not any(r.matches(n) for n in nodes)]


def differences(committed: dict, fresh: dict[str, list[str]]) -> list[str]:
    """What the committed selection lacks or has in excess, per entry."""
    out = []
    entries = committed.get("entries", {})
    for target in sorted(set(fresh) | set(entries)):
        if target not in entries:
            out.append(f"{target}: registry entry missing from the selection")
            continue
        if target not in fresh:
            out.append(f"{target}: in the selection but not in the registry")
            continue
        missing = sorted(set(fresh[target]) - set(entries[target]))
        extra = sorted(set(entries[target]) - set(fresh[target]))
        out += [f"{target}: missing {n}" for n in missing]
        out += [f"{target}: no longer touches it: {n}" for n in extra]
    return out


def fresh(src: Path) -> dict[str, list[str]]:
    """The selection a scan of ``src`` finds for the registry as installed."""
    return scan(src, registry_targets(), _vllm_root())


def _usage() -> int:
    print(__doc__.split("Usage::", 1)[1].strip(), file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        return _usage()
    command, arg = argv[0], Path(argv[1])
    if command == "write":
        import vllm_hybrid

        found = fresh(arg)
        SELECTION.write_text(render(vllm_hybrid.SUPPORTED_VLLM_VERSION, found))
        for target, nodes in found.items():
            print(f"{len(nodes):5d}  {target}")
        return 0
    if command == "check":
        problems = differences(load(), fresh(arg))
        if problems:
            print(
                f"{SELECTION.name} does not match vLLM's tests and the patch "
                "registry (rerun: python tests_upstream/select_tests.py write "
                f"{arg}):",
                file=sys.stderr,
            )
            for line in problems:
                print(f"  {line}", file=sys.stderr)
            return 1
        return 0
    if command == "run-list":
        selection, not_run = load(), parse_not_run(arg.read_text())
        stale = stale_rows(selection, not_run)
        if stale:
            print(
                f"rows of the 'Not run' table of {arg} that match no selected "
                f"test: {', '.join(stale)}",
                file=sys.stderr,
            )
            return 1
        print("\n".join(run_list(selection, not_run)))
        return 0
    return _usage()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
