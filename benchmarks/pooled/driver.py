"""The driver: one worker subprocess per model and mode (``--jobs`` of them
at once), started as the simulator starts its workers, their results joined
into one table."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.simulate import runner

from .config import BENCH_SCRIPT, MODES, BenchConfig, overlay_mode
from .report import (
    Row,
    admission_lines,
    comparison_rows,
    format_table,
    run_failures,
)


@dataclass(frozen=True)
class WorkerRun:
    """One finished worker subprocess: its report, or why there is none."""

    model: str
    mode: str
    wall_s: float
    log_path: str
    report: dict[str, Any] | None
    error: str = ""


def spawn_worker(
    model: str, mode: str, args: argparse.Namespace, cfg: BenchConfig, log_dir: Path
) -> WorkerRun:
    """Run one worker subprocess to completion as the simulator runs its
    workers (``runner.run_json_worker``: the overlay's switch, in-process
    engines), with vLLM's log lines kept."""
    name = f"{model}-{mode}"
    payload = {
        "model": model,
        "mode": mode,
        "workloads": args.workloads,
        "model_dir": str(args.model_dir),
        "config": asdict(cfg),
    }
    _say(f"{name}: worker started, log {log_dir / name}.log")
    start = time.perf_counter()
    argv = [sys.executable, str(BENCH_SCRIPT), "--worker"]
    result = runner.run_json_worker(
        argv, payload, overlay_mode(mode), log_dir, name, log_level=None
    )
    wall = time.perf_counter() - start
    error = "" if "model" in result else result["error"]  # no report written
    _say(f"{name}: worker ended after {wall:.0f} s {error}")
    report = None if error else result
    return WorkerRun(model, mode, wall, str(log_dir / f"{name}.log"), report, error)


def _say(message: str) -> None:
    print(f"[bench_pooled] {message}", flush=True)


def run_driver(args: argparse.Namespace, cfg: BenchConfig) -> int:
    """Spawn upstream and overlay workers per model, then print the table."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_pooled-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(model, mode) for model in args.models for mode in cfg.modes]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(lambda j: spawn_worker(*j, args, cfg, log_dir), jobs))
    total = time.perf_counter() - start
    by_key = {(run.model, run.mode): run for run in runs}
    rows: list[Row] = []
    notes: list[str] = []
    reference, *others = cfg.modes
    for model in args.models:
        ref = by_key[(model, reference)]
        for mode in others:
            run = by_key[(model, mode)]
            # the default pair keeps the model's name; others name theirs
            label = model if cfg.modes == MODES else f"{model} {mode}/{reference}"
            rows += comparison_rows(label, ref.report, run.report)
            notes += admission_lines(label, ref.report, run.report)
            rows.append(Row(label, "worker", "process wall s", ref.wall_s, run.wall_s))
    print()
    print(format_table(rows))
    if notes:
        print()
        print(*notes, sep="\n")
    problems = run_failures(runs)
    for run in runs:
        for where, text in ((run.report or {}).get("tracebacks") or {}).items():
            print(f"\n--- {run.model}/{run.mode} {where} ---\n{text}")
    if args.json:
        payload = {
            "config": asdict(cfg),
            "models": args.models,
            "workloads": args.workloads,
            "total_wall_s": total,
            "runs": [asdict(r) for r in runs],
            "table": [{**asdict(row), "ratio": row.ratio} for row in rows],
            "notes": notes,
            "problems": problems,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        _say(f"JSON written to {args.json}")
    _say(f"total {total:.0f} s, logs in {log_dir}")
    if problems:
        print("\nFAILURES:", *problems, sep="\n  ")
        return 1
    return 0
