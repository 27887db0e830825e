"""The before/after tables of docs/simulation.md's "What a decode step
copies" and "Prefill pacing": ``vllm-hybrid simulate`` for
Qwen3.6-35B-A3B-FP8, upstream against pooled mode under decode edge policies
(``VLLM_HYBRID_DECODE_EDGES``), admission growth reserves
(``VLLM_HYBRID_ADMISSION_GROWTH``, state pages), prefill pacings
(``VLLM_HYBRID_PREFILL_PACING``) and state eviction windows
(``VLLM_HYBRID_STATE_EVICTION_WINDOW``).

Usage::

    python scripts/decode_copies_table.py OUT_DIR [--requests N]
        [--workloads mooncake,chat_server] [--cases 80-tq,48-bf16,...]
        [--variants every:0:fill,budget_end:0:fill,budget_end:1:state_page]
        [--offline]

A variant is ``POLICY:PAGES[:PACING[:WINDOW]]`` (pacing ``fill`` and the
default window when left out), or ``default``: pooled mode as it ships,
none of the variables set (its rows are labelled ``pooled``).
``every:0`` is pooled mode before edges could be crossed in place (a copy at
every state block edge) and before the growth reserve; ``budget_end:1:fill``
is pooled mode before prefill pacing; ``budget_end:1:state_page`` is the
default.
Each run keeps its JSON in ``OUT_DIR`` and is not run again when it is there.
The Markdown table goes to standard output, one per workload; ratios are to
upstream of the same case. ``--offline`` reads the runs already in
``OUT_DIR`` only and prints one workload's table alone (the docs' generated
blocks over runs committed under ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
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

from vllm_hybrid import envs
from vllm_hybrid.tools.simulate.cli import main as simulate
from vllm_hybrid.tools.simulate.report import best_runs, flat_figures
from vllm_hybrid.v1.core.pooled.policy import PrefillPacing

HEADER = (
    "| case | engine | state copies | copied, GB | preemptions | prefill tokens "
    "| hit rate | TPOT p50 / p99, ms (modeled) | TTFT p50 / p99, s (modeled) |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def run(out: Path, workload: str, case: str, engine: str, variant: str, args) -> dict:
    """One engine's summary (its best run), simulated unless cached."""
    tag = run_tag(engine, variant)
    path = out / f"{workload}-{case}-{tag}.json"
    if not path.is_file() and args.offline:
        raise SystemExit(f"{path}: not there (--offline reads saved runs only)")
    if not path.is_file():
        argv = [MODEL, *CASES[case], "--workload", workload, "--json", str(path)]
        argv += ["--engines", engine, "--jobs", "1", "--no-progress"]
        if workload == "mooncake" and args.requests:
            argv += ["--requests", str(args.requests)]
        if workload == "chat_server":
            argv += ["--shape", json.dumps(CHAT_SHAPE)]
        print(f"[decode copies] {workload} {case} {tag}", file=sys.stderr, flush=True)
        set_variant(variant)
        simulate(argv)
    return best_runs(json.loads(path.read_text())["engines"])[engine]


#: The variables a variant sets (``default`` sets none).
VARIANT_VARS = (
    envs.DECODE_EDGES_VAR,
    envs.ADMISSION_GROWTH_VAR,
    envs.PREFILL_PACING_VAR,
    envs.STATE_EVICTION_WINDOW_VAR,
)


def set_variant(variant: str) -> None:
    """The environment the simulator's engine processes inherit."""
    for var in VARIANT_VARS:
        os.environ.pop(var, None)
    if variant != "default":
        os.environ.update(zip(VARIANT_VARS, parse_variant(variant), strict=True))


def run_tag(engine: str, variant: str) -> str:
    """The run's part of its JSON file's name."""
    if engine == "upstream" or variant == "default":
        return engine
    policy, pages, pacing, window = parse_variant(variant)
    tag = f"{engine}-{policy}-g{pages}"
    if pacing != PrefillPacing.FILL.value:
        tag += f"-{pacing}"
    return f"{tag}-w{window}" if window else tag


def variant_label(variant: str) -> str:
    """The engine column of a pooled run."""
    if variant == "default":
        return "pooled"
    policy, pages, pacing, window = parse_variant(variant)
    label = f"pooled, {policy}, reserve {pages}, {pacing}"
    return f"{label}, window {window}" if window else label


def parse_variant(variant: str) -> tuple[str, str, str, str]:
    """(decode edges, growth pages, pacing, state eviction window; "" for the
    default) of ``POLICY:PAGES[:PACING[:WINDOW]]``."""
    policy, pages, *rest = variant.split(":")
    pacing = rest[0] if rest else PrefillPacing.FILL.value
    return policy, pages, pacing, rest[1] if len(rest) > 1 else ""


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
        return f"| {case} | {label} | failed | | | | | | |"
    figures = flat_figures(summary)
    c, m = figures["counted"], figures["modeled"]
    ref_c = flat_figures(reference)["counted"] if reference else {}
    ref_m = flat_figures(reference)["modeled"] if reference else {}
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
        f"| {tpot} | {ttft} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workloads", type=names, default=["mooncake"])
    parser.add_argument("--cases", type=names, default=["80-tq", "48-bf16"])
    parser.add_argument(
        "--variants",
        type=names,
        default=["budget_end:1:fill", "budget_end:1:state_page"],
    )
    add_offline(parser)
    args = parse(parser, argv)
    for workload in args.workloads:
        rows = []
        for case in args.cases:
            upstream = run(args.out, workload, case, "upstream", "default", args)
            rows.append(row(case, "upstream", upstream, None))
            for variant in args.variants:
                pooled = run(args.out, workload, case, "pooled", variant, args)
                rows.append(row(case, variant_label(variant), pooled, upstream))
        print_table(args, workload, HEADER, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
