"""The copies tables of docs/simulation.md ("What a decode step copies"):
``vllm-hybrid simulate`` for Qwen3.6-35B-A3B-FP8, upstream against pooled
mode as it ships.

Usage::

    python scripts/decode_copies_table.py OUT_DIR [--requests N]
        [--workloads mooncake,chat_server] [--cases 80-tq,48-bf16,...]
        [--offline]

Each run keeps its JSON in ``OUT_DIR`` and is not run again when it is there.
The Markdown table goes to standard output, one per workload; ratios are to
upstream of the same case. ``--offline`` reads the runs already in
``OUT_DIR`` only and prints one workload's table alone (the docs' generated
blocks over runs committed under ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from simulation_tables import (
    CASES,
    CHAT_SHAPE,
    MODEL,
    add_offline,
    names,
    parse,
    print_table,
)

from vllm_hybrid.tools.simulate.cli import main as simulate
from vllm_hybrid.tools.simulate.report import best_runs, flat_figures

HEADER = (
    "| case | engine | state copies | copied, GB | preemptions | prefill tokens "
    "| hit rate | TPOT p50 / p99, ms (modeled) | TTFT p50 / p99, s (modeled) "
    "| scheduler CPU per step, ms (this host) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def run(out: Path, workload: str, case: str, engine: str, args) -> dict:
    """One engine's summary (its best run), simulated unless cached."""
    path = out / f"{workload}-{case}-{engine}.json"
    if not path.is_file() and args.offline:
        raise SystemExit(f"{path}: not there (--offline reads saved runs only)")
    if not path.is_file():
        argv = [MODEL, *CASES[case], "--workload", workload, "--json", str(path)]
        argv += ["--engines", engine, "--jobs", "1", "--no-progress"]
        if workload == "mooncake":
            argv += ["--requests", str(args.requests or "all")]
        if workload == "chat_server":
            argv += ["--shape", json.dumps(CHAT_SHAPE)]
        print(
            f"[decode copies] {workload} {case} {engine}", file=sys.stderr, flush=True
        )
        simulate(argv)
    return best_runs(json.loads(path.read_text())["engines"])[engine]


def _pair(a: float | None, b: float | None, scale: float, fmt: str) -> str:
    if a is None or b is None:
        return "-"
    return f"{fmt.format(a * scale)} / {fmt.format(b * scale)}"


def _ratio(value: float | None, reference: float | None, digits: int = 2) -> str:
    if not value or not reference:
        return ""
    return f" ({value / reference:.{digits}f}x)"


def _ratios(figures: dict, reference: dict, *keys: str) -> str:
    """`` (a / b)``: the ratios of two figures to the reference's."""
    parts = []
    for key in keys:
        value, ref = figures.get(key), reference.get(key)
        parts.append(f"{value / ref:.2f}x" if value and ref else "-")
    return f" ({' / '.join(parts)})"


def row(case: str, label: str, summary: dict, reference: dict | None) -> str:
    if "error" in summary:
        return f"| {case} | {label} | failed | | | | | | | |"
    figures = flat_figures(summary)
    c, m, h = figures["counted"], figures["modeled"], figures["host"]
    ref = flat_figures(reference) if reference else {}
    ref_c, ref_m = ref.get("counted", {}), ref.get("modeled", {})
    cpu = "-" if h["cpu_mean_ms"] is None else f"{h['cpu_mean_ms']:.2f}"
    if reference is not None and h["cpu_mean_ms"] is not None:
        cpu += _ratio(h["cpu_mean_ms"], ref["host"]["cpu_mean_ms"])
    tpot = _pair(m.get("tpot_p50_ms"), m.get("tpot_p99_ms"), 1, "{:.1f}")
    ttft = _pair(m.get("ttft_p50"), m.get("ttft_p99"), 1, "{:.2f}")
    if reference is not None:
        tpot += _ratios(m, ref_m, "tpot_p50_ms", "tpot_p99_ms")
        ttft += _ratios(m, ref_m, "ttft_p50", "ttft_p99")
    prefill = f"{c['prefill_tokens']:,}" + _ratio(
        c["prefill_tokens"], ref_c.get("prefill_tokens"), 3
    )
    return (
        f"| {case} | {label} | {c['copies_moved']:,} | {c['copy_gb']:,.0f} "
        f"| {c['preemptions']:,} | {prefill} | {c['hit_rate'] or 0:.3f} "
        f"| {tpot} | {ttft} | {cpu} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workloads", type=names, default=["mooncake"])
    parser.add_argument("--cases", type=names, default=["80-tq", "48-bf16"])
    add_offline(parser)
    args = parse(parser, argv)
    for workload in args.workloads:
        rows = []
        for case in args.cases:
            upstream = run(args.out, workload, case, "upstream", args)
            rows.append(row(case, "upstream", upstream, None))
            pooled = run(args.out, workload, case, "pooled", args)
            rows.append(row(case, "pooled", pooled, upstream))
        print_table(args, workload, HEADER, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
