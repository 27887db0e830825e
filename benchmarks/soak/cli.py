"""Command line of the soak (``python benchmarks/soak``) and its summary."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from benchmarks.harness import KV_CACHE_DTYPES, MIB, MODELS
from testing.loopback import MODES

from .client import RESULTS
from .config import SoakConfig
from .runner import ModeReport, run_mode

#: Table headers of the results.
SHORT = ("ok", "400*", "disc", "4xx!", "5xx", "inv", "serr", "hang", "conn")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/soak",
        description="Soak a live vllm-hybrid server of a tiny hybrid on 127.0.0.1 "
        "with a bounded, seeded request mix; check it after every phase; exit 1 "
        "on any failed check.",
    )
    p.add_argument("--mode", choices=[*MODES, "both"], default="both")
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES)
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--json", type=Path, help="also write every report to this file")
    # Every number of SoakConfig, as it names it.
    types = {"int": int, "float": float, "Path": Path, "int | None": int}
    for f in fields(SoakConfig):
        if f.type in types:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=types[f.type])
    p.add_argument("--compile", action="store_true", help="no --enforce-eager")
    p.add_argument(
        "--request-seeds",
        action="store_true",
        help="give sampled requests a per-request seed (vLLM 0.32 on CPU then "
        "crashes on prompts longer than one prefill step, in both modes)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    given = {
        f.name: getattr(args, f.name)
        for f in fields(SoakConfig)
        if getattr(args, f.name, None) not in (None, False)
    }
    modes = tuple(MODES) if args.mode == "both" else (args.mode,)
    cfg = SoakConfig(**given, modes=modes)
    if cfg.requests < 1:
        raise SystemExit("soak: --requests must be >= 1")
    return cfg


def summary(report: ModeReport) -> str:
    """One screen per mode: phases, then every check."""
    cfg = report.config
    lines = [
        f"== soak {report.mode}: {report.model}, {report.kv_cache_dtype}, KV "
        f"{cfg['kv_cache_mib']} MiB, max_model_len {cfg['max_model_len']}, "
        f"max_num_seqs {cfg['max_num_seqs']}, seed {cfg['seed']} ==",
        f"server start {report.startup_seconds:.0f}s; total {report.seconds:.0f}s; "
        f"log {report.log_path}",
        *(f"  {line}" for line in report.plan_lines[:2]),
        f"{'phase':<10}{'sent':>6}{'thr':>5}{'s':>6}"
        + "".join(f"{h:>6}" for h in SHORT)
        + f"{'p50 s':>7}{'max s':>7}{'preem':>7}{'RSS MiB':>9}",
    ]
    if report.error:
        lines.insert(2, f"ERROR: {report.error}")
    for p in report.phases:
        rss = sum(report.rss.get(p.name, {}).values()) / MIB
        lines.append(
            f"{p.name:<10}{p.sent:>6}{p.threads:>5}{p.seconds:>6.0f}"
            + "".join(f"{p.counts.get(r, 0):>6}" for r in RESULTS)
            + f"{p.latency.get('p50', 0):>7.2f}{p.latency.get('max', 0):>7.1f}"
            + f"{p.preemptions:>7.0f}{rss:>9.0f}"
        )
        lines += [f"  ! {p.name}: {failure}" for failure in p.failures]
    lines.append(
        "(400* = expected 400 for prompts beyond max_model_len; disc = client "
        "disconnected on purpose; preem = preemptions so far)"
    )
    for where, check in report.all_checks:
        if where == "end" or not check.ok:
            mark = ("PASS" if check.ok else "FAIL") if check.judged else "INFO"
            lines.append(f"{mark} [{where}] {check.name}: {check.detail}")
    growth = report.growth(report.rss_middle_phase, "end")
    lines.append(
        f"RSS growth {report.rss_middle_phase} -> end, MiB: "
        + ", ".join(f"{k} {v / MIB:+.1f}" for k, v in growth.items())
    )
    lines.append(f"RESULT {report.mode}: {'PASS' if report.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    reports = []
    for mode in cfg.modes:
        reports.append(run_mode(cfg, mode, lambda x: print(x, file=sys.stderr)))
        print(summary(reports[-1]) + "\n")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return 0 if all(r.ok for r in reports) else 1
