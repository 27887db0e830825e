"""Regenerate or check the command outputs shown in the docs.

A documented output is only true until the code changes, so every example
output in the markdown is generated: a marker line names the command, and the
fenced block right after it holds ``$ COMMAND`` and what the command prints::

    <!-- generated: vllm-hybrid plan qwen3.5-35b-a3b --kv-cache-memory 8GiB -->
    ```
    $ vllm-hybrid plan qwen3.5-35b-a3b --kv-cache-memory 8GiB
    ...
    ```

A marker ``<!-- generated markdown: COMMAND -->`` instead takes the lines up
to the next blank line as the command's output as it is (a markdown table
the command prints), without the ``$ COMMAND`` line or a fence.

``--write`` reruns every marked command and rewrites its block; ``--check``
(the default) reports each block that differs from what its command prints
now and exits 1 (``tests/test_docs_generated.py`` runs it). Only commands
that are fast and print the same on every host may be marked (:data:`RUNNERS`):
``vllm-hybrid plan`` on configs and presets (no weights, no engine), and the
scripts that render results committed under ``benchmarks/results/``
(simulator runs with ``--offline``, which reads their JSON and never
simulates; a GPU run's kernel timings), and pooled mode's eviction order
rendered from its policy module. They run in this process from the
repository root, so vLLM is imported once for all of them.

Usage: python scripts/gen_docs.py [--check | --write] [FILE.md ...]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Files searched for markers when none are named.
DEFAULT_FILES = ("README.md", "docs/*.md")

MARKER = re.compile(r"^<!-- generated(?P<markdown> markdown)?: (?P<command>.+?) -->$")
FENCE = re.compile(r"^(?P<fence>`{3,})[\w-]*$")
#: Commands a marker may name: program and subcommand or script -> whether
#: the command must carry ``--offline`` (render saved runs, never simulate).
RUNNERS: dict[tuple[str, str], bool] = {
    ("vllm-hybrid", "plan"): False,
    ("python", "scripts/simulation_tables.py"): True,
    ("python", "scripts/decode_copies_table.py"): True,
    ("python", "scripts/gpu/report.py"): False,
    ("python", "scripts/eviction_order.py"): False,
}
#: The displayed command is wrapped before an option past this width.
WRAP_WIDTH = 80
CONTINUATION = " \\\n      "


class DocError(ValueError):
    """A marker without its block, or a command that cannot be generated."""


@dataclass(frozen=True)
class Block:
    """One generated block: its command and the lines it spans."""

    command: str
    #: Index of the first line inside the fence, and of the closing fence
    #: (markdown blocks: of the first line after the marker and of the blank
    #: line that ends them).
    start: int
    end: int
    #: The command prints markdown, shown as it is.
    markdown: bool = False


def find_blocks(lines: Sequence[str], name: str = "<doc>") -> list[Block]:
    """Every marker in ``lines`` with the fenced block that follows it."""
    blocks = []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if match is None:
            continue
        if match.group("markdown"):
            end = next(
                (j for j in range(i + 1, len(lines)) if not lines[j].strip()),
                len(lines),
            )
            blocks.append(Block(match.group("command"), i + 1, end, markdown=True))
            continue
        fence = FENCE.match(lines[i + 1].strip()) if i + 1 < len(lines) else None
        if fence is None:
            raise DocError(f"{name}:{i + 1}: marker not followed by a ``` block")
        closing = fence.group("fence")
        for j in range(i + 2, len(lines)):
            if lines[j].strip() == closing:
                blocks.append(Block(match.group("command"), i + 2, j))
                break
        else:
            raise DocError(f"{name}:{i + 2}: block after the marker is not closed")
    return blocks


def display(command: str) -> str:
    """``$ command``, wrapped before options so that lines stay short."""
    groups: list[str] = []
    for token in shlex.split(command):
        if token.startswith("-") or not groups or len(groups) <= 2:
            groups.append(shlex.quote(token))
        else:
            groups[-1] += " " + shlex.quote(token)
    lines = ["$"]
    for group in groups:
        if len(lines[-1]) + 1 + len(group) > WRAP_WIDTH and len(lines[-1]) > 6:
            lines.append("")
        lines[-1] = f"{lines[-1]} {group}" if lines[-1] else group
    return CONTINUATION.join(lines)


def _entry(program: tuple[str, str]) -> Callable[[list[str]], int]:
    """The ``main(argv)`` a marked command runs."""
    if program == ("vllm-hybrid", "plan"):
        from vllm_hybrid.tools.plan.cli import main

        return main
    script = ROOT / program[1]
    # the simulation scripts import each other by their module names
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(f"gen_docs_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.main


@functools.cache
def run(command: str) -> str:
    """What ``command`` prints; it runs in this process (see module doc)."""
    argv = shlex.split(command)
    program = tuple(argv[:2])
    if program not in RUNNERS:
        known = ", ".join(f"'{' '.join(p)} ...'" for p in RUNNERS)
        raise DocError(f"{command!r}: only {known} are generated")
    if RUNNERS[program] and "--offline" not in argv:
        raise DocError(f"{command!r}: needs --offline (a doc check never simulates)")
    main = _entry(program)
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.chdir(ROOT),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main(argv[2:])
    if code != 0:
        raise DocError(f"{command!r} exited {code}: {err.getvalue().strip()}")
    return out.getvalue().rstrip("\n")


def regenerate(text: str, runner: Callable[[str], str] = run, name: str = "") -> str:
    """``text`` with every generated block replaced by its command's output."""
    lines = text.split("\n")
    for block in reversed(find_blocks(lines, name)):
        output = runner(block.command)
        body = output if block.markdown else f"{display(block.command)}\n{output}"
        lines[block.start : block.end] = body.split("\n")
    return "\n".join(lines)


def differences(path: Path, runner: Callable[[str], str] = run) -> str:
    """A unified diff from ``path`` to its regenerated text ('' if current)."""
    text = path.read_text()
    new = regenerate(text, runner, str(path))
    return "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"{path} (documented)",
            tofile=f"{path} (generated now)",
        )
    )


def doc_files(names: Sequence[str]) -> list[Path]:
    """The named files, or every default file that has a marker."""
    if names:
        return [Path(n) for n in names]
    found = [p for pattern in DEFAULT_FILES for p in sorted(ROOT.glob(pattern))]
    return [p for p in found if find_blocks(p.read_text().split("\n"), str(p))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report stale blocks")
    mode.add_argument("--write", action="store_true", help="rewrite the blocks")
    parser.add_argument("files", nargs="*", help="markdown files (default: docs)")
    args = parser.parse_args(argv)
    stale = 0
    for path in doc_files(args.files):
        if args.write:
            text = path.read_text()
            new = regenerate(text, name=str(path))
            if new != text:
                path.write_text(new)
                print(f"rewrote {path}")
            continue
        diff = differences(path)
        if diff:
            stale += 1
            sys.stdout.write(diff)
    if stale:
        print(f"{stale} file(s) out of date: python scripts/gen_docs.py --write")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
