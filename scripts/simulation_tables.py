"""The tables of docs/simulation.md: ``vllm-hybrid simulate`` for
Qwen3.6-35B-A3B-FP8 on each GPU size and KV cache dtype, one row per engine.

Usage::

    python scripts/simulation_tables.py OUT_DIR [--requests N]
        [--workloads mooncake,chat_server] [--cases 80-tq,48-bf16,...]
        [--engines A,B] [--jobs N]

Each case runs the simulator once (every engine of ``--engines``, sweeps
included) and keeps its JSON in ``OUT_DIR``; a case whose JSON is already
there is not run again, so an interrupted run resumes. The Markdown tables
go to standard output, one per workload.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_hybrid.tools.simulate.cli import main as simulate
from vllm_hybrid.tools.simulate.report import SUMMARY_HEADER, render_summary

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


def _names(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def run_case(
    out: Path, case: str, workload: str, args: argparse.Namespace
) -> dict | None:
    path = out / f"{workload}-{case}.json"
    if not path.is_file():
        argv = [MODEL, *CASES[case], "--workload", workload, "--json", str(path)]
        argv += ["--jobs", str(args.jobs), "--no-progress"]
        if args.engines:
            argv += ["--engines", args.engines]
        if workload == "mooncake" and args.requests:
            argv += ["--requests", str(args.requests)]
        if workload == "chat_server":
            argv += ["--shape", json.dumps(CHAT_SHAPE)]
        print(f"[simulation] {workload} {case}", file=sys.stderr, flush=True)
        simulate(argv)
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--workloads", type=_names, default=["mooncake", "chat_server"])
    parser.add_argument("--cases", type=_names, default=list(CASES))
    parser.add_argument("--engines", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads:
        rows = []
        for case in args.cases:
            result = run_case(args.out, case, workload, args)
            if result is not None:
                rows.append(render_summary(result["engines"], case))
        print(f"\n{workload}\n\n{SUMMARY_HEADER}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
