"""The tables of docs/simulation.md: ``vllm-hybrid simulate`` for
Qwen3.6-35B-A3B-FP8 on each GPU size and KV cache dtype, one row per engine.

Usage::

    python scripts/simulation_tables.py OUT_DIR [--requests N]
        [--workloads mooncake,chat_server,reasoning-chat,agent]
        [--cases 80-tq,48-bf16,...] [--engines A,B] [--jobs N] [--offline]

Each case runs the simulator once (every engine of ``--engines``, sweeps
included) and keeps its JSON in ``OUT_DIR``; a case whose JSON is already
there is not run again, so an interrupted run resumes. The Markdown tables
go to standard output, one per workload. ``--offline`` only reads the JSON
already in ``OUT_DIR`` (a missing one is an error) and prints the table of
the one workload alone, as the docs' generated blocks show the runs
committed under ``benchmarks/results/``. ``reasoning-chat`` and ``agent``
are traces with follow-ups, written first into ``OUT_DIR`` by
``vllm-hybrid make-trace`` at :data:`TRACE_SHAPES` (seed 0); their tables
add the floor (prompt tokens no cache could serve).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_hybrid.tools.simulate.cli import main as simulate
from vllm_hybrid.tools.simulate.report import (
    FLOOR_HEADER,
    SUMMARY_HEADER,
    render_floor_summary,
    render_summary,
)
from vllm_hybrid.tools.simulate.runner import ENGINES
from vllm_hybrid.tools.tracegen.cli import main as make_trace

MODEL = "qwen3.6-35b-a3b-fp8"
#: case name -> the simulator's device arguments
CASES: dict[str, list[str]] = {
    "24x2-bf16": ["--gpu-memory", "24", "-tp", "2"],
    "24x2-tq": [
        "--gpu-memory",
        "24",
        "-tp",
        "2",
        "--kv-cache-dtype",
        "turboquant_k8v4",
    ],
    "48-bf16": ["--gpu-memory", "48"],
    "48-tq": ["--gpu-memory", "48", "--kv-cache-dtype", "turboquant_k8v4"],
    "80-bf16": ["--gpu-memory", "80"],
    "80-tq": ["--gpu-memory", "80", "--kv-cache-dtype", "turboquant_k8v4"],
    "141-bf16": ["--gpu-memory", "141"],
    "141-tq": ["--gpu-memory", "141", "--kv-cache-dtype", "turboquant_k8v4"],
}
#: chat_server at a size a GPU serves: many conversations sharing a long
#: system prompt, interleaved
CHAT_SHAPE = {
    "conversations": 256,
    "turns": 6,
    "system_len": 2000,
    "user_min": 50,
    "user_max": 400,
    "output": 200,
    "concurrency": 64,
}

#: traces with follow-ups at a size this 2-core machine runs in minutes:
#: make-trace's shape over its defaults (docs/simulation.md)
TRACE_SHAPES = {
    "reasoning-chat": {"conversations": 48},
    "agent": {"tasks": 6},
}


def names(text: str) -> list[str]:
    """A comma-separated command-line list."""
    return [p for p in text.split(",") if p]


def check_cases(parser: argparse.ArgumentParser, cases: list[str]) -> None:
    """Stop with the parser's error on a case :data:`CASES` does not name."""
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")


def _trace(out: Path, workload: str) -> Path:
    """The workload's trace in ``out``, written if not there yet."""
    path = out / f"{workload}.jsonl"
    if not path.is_file():
        shape = json.dumps(TRACE_SHAPES[workload])
        make_trace([workload, str(path), "--seed", "0", "--shape", shape])
    return path


def run_case(
    out: Path, case: str, workload: str, args: argparse.Namespace
) -> dict | None:
    path = out / f"{workload}-{case}.json"
    if not path.is_file() and args.offline:
        raise SystemExit(f"{path}: not there (--offline reads saved runs only)")
    if not path.is_file():
        source = ["--workload", workload]
        if workload in TRACE_SHAPES:
            source = ["--trace", str(_trace(out, workload))]
        argv = [MODEL, *CASES[case], *source, "--json", str(path)]
        argv += ["--jobs", str(args.jobs), "--no-progress"]
        # every engine and every request unless asked otherwise (the command's
        # own defaults are a short run)
        argv += ["--engines", args.engines or ",".join(ENGINES)]
        if workload == "mooncake":
            argv += ["--requests", str(args.requests or "all")]
        if workload in TRACE_SHAPES:
            argv += ["--requests", "all"]
        if workload == "chat_server":
            argv += ["--shape", json.dumps(CHAT_SHAPE)]
        print(f"[simulation] {workload} {case}", file=sys.stderr, flush=True)
        simulate(argv)
    return json.loads(path.read_text()) if path.is_file() else None


def add_offline(parser: argparse.ArgumentParser) -> None:
    """The ``--offline`` option both table scripts take."""
    parser.add_argument(
        "--offline",
        action="store_true",
        help="only read the runs in OUT_DIR; print one workload's table alone",
    )


def print_table(args: argparse.Namespace, workload: str, header: str, rows) -> None:
    """One workload's table: titled, or alone with ``--offline``."""
    table = f"{header}\n" + "\n".join(rows)
    print(table if args.offline else f"\n{workload}\n\n{table}")


def parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The arguments, checked; OUT_DIR made unless ``--offline``."""
    args = parser.parse_args(argv)
    check_cases(parser, args.cases)
    if args.offline and len(args.workloads) != 1:
        parser.error("--offline prints one workload's table: name one")
    if not args.offline:
        args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--workloads", type=names, default=["mooncake", "chat_server"])
    parser.add_argument("--cases", type=names, default=list(CASES))
    parser.add_argument("--engines", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    add_offline(parser)
    args = parse(parser, argv)
    for workload in args.workloads:
        rows = []
        followups = workload in TRACE_SHAPES
        render = render_floor_summary if followups else render_summary
        for case in args.cases:
            result = run_case(args.out, case, workload, args)
            if result is not None:
                rows.append(render(result["engines"], case))
        header = FLOOR_HEADER if followups else SUMMARY_HEADER
        print_table(args, workload, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
