"""Part ``tier`` of the device run: the kernel conformance tier
(``tests/kernels``) in its own pytest process.

On a GPU ``tests/kernels/conftest.py`` leaves Triton's interpreter off, so
every test runs upstream's compiled kernels on CUDA tensors: pooled-mode views
against contiguous twins, outputs and owned pages equal, canaries intact.
With ``pytest-xdist`` present (the device image has it) the tests run in 4
worker processes, by module, so Triton's compilations and autotuning overlap.
Each finished test is appended to a JSON-lines file as it ends (see
``tier_report``), so a run stopped at its budget still reports what passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path

from tier_env import ROOT, run_bounded, write_json

#: Worker processes when pytest-xdist is there (compilation is CPU-bound;
#: the device has 16 cores and one GPU).
WORKERS = 4


def pytest_command(parallel: bool, select: str = "") -> list[str]:
    command = [sys.executable, "-m", "pytest", "tests/kernels", "--kernel-tier"]
    if select:
        command += ["-k", select]
    command += ["-q", "-rs", "-p", "no:cacheprovider", "--hypothesis-profile=ci"]
    command += ["-p", "tier_report"]
    if parallel:
        command += ["-n", str(WORKERS), "--dist", "loadfile"]
    return command


def summarize(lines: list[dict]) -> dict:
    outcomes = Counter(entry["outcome"] for entry in lines)
    slowest = sorted(lines, key=lambda e: -e["seconds"])[:8]
    return {
        "passed": outcomes["passed"],
        "failed": outcomes["failed"],
        "skipped": outcomes["skipped"],
        "failures": [e for e in lines if e["outcome"] == "failed"],
        "slowest": [(e["test"], e["seconds"]) for e in slowest],
        "tests": lines,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=600)
    parser.add_argument(
        "--select", default="", help="pytest -k expression: a rerun of some tests"
    )
    args = parser.parse_args(argv)
    report = Path(args.out).with_suffix(".jsonl.tmp")
    report.unlink(missing_ok=True)
    parallel = importlib.util.find_spec("xdist") is not None
    env = dict(os.environ, TIER_REPORT=str(report))
    command = pytest_command(parallel, args.select)
    rc, output = run_bounded(command, args.budget - 5, cwd=ROOT, env=env)
    over, tail = rc is None, output[-4000:]
    lines = []
    if report.exists():
        lines = [json.loads(line) for line in report.read_text().splitlines()]
        report.unlink()
    result = {"command": " ".join(command[1:]), "parallel": parallel}
    result |= {"rc": rc, "over_budget": over, **summarize(lines), "tail": tail}
    write_json(args.out, result)
    print(tail)
    print(
        f"tier: {result['passed']} passed, {result['failed']} failed,"
        f" {result['skipped']} skipped{' (stopped at budget)' if over else ''}"
    )
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
