"""The driver: one worker subprocess per model and mode (``--jobs`` of them
at once), their results joined into one table."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.simulate import runner

from .config import BENCH_SCRIPT, MODES, RESULT_PREFIX, SERVER_MODE, BenchConfig
from .report import Row, comparison_rows, format_table, run_failures, start_error_notes


@dataclass(frozen=True)
class WorkerRun:
    """One finished worker subprocess."""

    model: str
    mode: str
    returncode: int
    wall_s: float
    log_path: str
    report: dict[str, Any] | None


def parse_result(text: str) -> dict[str, Any] | None:
    """The last ``BENCH_RESULT`` JSON line of a worker's output."""
    lines = [line for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX)) if lines else None


def worker_env(mode: str, threads: int = 0, first_core: int = 0) -> dict[str, str]:
    """Environment of a worker: the simulator's (the overlay switch,
    in-process engines; vLLM's log lines all kept) and, with ``threads`` > 0,
    that many OpenMP threads from ``first_core`` on."""
    overlay = SERVER_MODE[mode] != "upstream"
    env = runner.worker_env(overlay, log_level=None)
    if threads > 0:
        last = first_core + threads - 1
        bind = str(first_core) if threads == 1 else f"{first_core}-{last}"
        env |= {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": bind}
    return env


@dataclass(frozen=True)
class WorkerJob:
    """One worker process to run: a model, a mode and its workloads."""

    model: str
    mode: str
    workloads: tuple[str, ...]
    #: OpenMP threads (0: the platform's choice), see ``worker_env``
    threads: int = 0

    @property
    def name(self) -> str:
        part = "" if self.threads == 0 else f"-{'+'.join(self.workloads)}"
        return f"{self.model}-{self.mode}{part}"


def worker_jobs(
    models: Sequence[str], workloads: Sequence[str], cfg: BenchConfig
) -> list[WorkerJob]:
    """Per model and mode, one worker with the platform's threads and, unless
    ``same_tokens_threads`` is 0, one for same_tokens with that many."""
    separate = "same_tokens" in workloads and cfg.same_tokens_threads > 0
    rest = tuple(w for w in workloads if not (separate and w == "same_tokens"))
    jobs = []
    for model in models:
        for mode in cfg.modes:
            if rest:
                jobs.append(WorkerJob(model, mode, rest))
            if separate:
                jobs.append(
                    WorkerJob(model, mode, ("same_tokens",), cfg.same_tokens_threads)
                )
    return jobs


def merge_runs(runs: Sequence[WorkerRun]) -> dict[tuple[str, str], WorkerRun]:
    """One run per (model, mode): its workers' workloads, errors and
    tracebacks joined, engine facts and geometry from the first that has them."""
    merged: dict[tuple[str, str], WorkerRun] = {}
    for run in runs:
        key = (run.model, run.mode)
        prev = merged.get(key)
        if prev is None:
            merged[key] = run
            continue
        report = _merge_reports(prev.report, run.report)
        merged[key] = WorkerRun(
            run.model,
            run.mode,
            prev.returncode or run.returncode,
            prev.wall_s + run.wall_s,
            f"{prev.log_path}; {run.log_path}",
            report,
        )
    return merged


def _merge_reports(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return None
    out = dict(a)
    out["workloads"] = {**a.get("workloads", {}), **b.get("workloads", {})}
    out["engines"] = {**b.get("engines", {}), **a.get("engines", {})}
    out["geometry"] = a.get("geometry") or b.get("geometry")
    out["errors"] = [*a.get("errors", []), *b.get("errors", [])]
    out["tracebacks"] = {**b.get("tracebacks", {}), **a.get("tracebacks", {})}
    return out


class CoreSlots:
    """Cores of the workers pinned to T threads: with ``--jobs N`` each takes
    a free slot k of N and gets cores ``k*T .. k*T+T-1`` (modulo the cores)."""

    def __init__(self, jobs: int) -> None:
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for k in range(jobs):
            self._free.put(k)

    @contextlib.contextmanager
    def first_core(self, threads: int) -> Iterator[int]:
        slot = self._free.get()
        try:
            cores = os.cpu_count() or 1
            yield (slot * threads) % cores if threads > 0 else 0
        finally:
            self._free.put(slot)


def spawn_worker(
    job: WorkerJob,
    args: argparse.Namespace,
    cfg: BenchConfig,
    log_dir: Path,
    slots: CoreSlots,
) -> WorkerRun:
    """Run one worker subprocess to completion, its output in a log file."""
    model, mode = job.model, job.mode
    log_path = log_dir / f"{job.name}.log"
    options = {
        "--models": model,
        "--workloads": ",".join(job.workloads),
        "--model-dir": str(args.model_dir),
        "--config-json": json.dumps(asdict(cfg)),
        "--mode": mode,
    }
    cmd = [sys.executable, str(BENCH_SCRIPT), "--worker", *sum(options.items(), ())]
    _say(f"{job.name}: worker started, log {log_path}")
    start = time.perf_counter()
    with slots.first_core(job.threads) as first_core:
        env = worker_env(mode, job.threads, first_core)
        returncode = runner.run_logged(cmd, env, log_path)
    wall = time.perf_counter() - start
    report = parse_result(log_path.read_text(errors="replace"))
    _say(f"{job.name}: worker exited {returncode} after {wall:.0f} s")
    return WorkerRun(model, mode, returncode, wall, str(log_path), report)


def _say(message: str) -> None:
    print(f"[bench_pooled] {message}", flush=True)


def run_driver(args: argparse.Namespace, cfg: BenchConfig) -> int:
    """Spawn upstream and overlay workers per model, then print the table."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_pooled-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs = worker_jobs(args.models, args.workloads, cfg)
    slots = CoreSlots(max(1, args.jobs))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(
            pool.map(lambda job: spawn_worker(job, args, cfg, log_dir, slots), jobs)
        )
    total = time.perf_counter() - start
    by_key = merge_runs(runs)
    rows: list[Row] = []
    reference, *others = cfg.modes
    for model in args.models:
        ref = by_key[(model, reference)]
        for mode in others:
            run = by_key[(model, mode)]
            # the default pair keeps the model's name; others name theirs
            label = model if cfg.modes == MODES else f"{model} {mode}/{reference}"
            rows += comparison_rows(label, ref.report, run.report)
            rows.append(Row(label, "worker", "process wall s", ref.wall_s, run.wall_s))
    print()
    print(format_table(rows))
    notes = start_error_notes(runs)
    if notes:
        print("\nEngine start notes:", *notes, sep="\n  ")
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
            "runs": [asdict(r) for r in by_key.values()],
            "worker_runs": [asdict(r) for r in runs],
            "table": [{**asdict(row), "ratio": row.ratio} for row in rows],
            "problems": problems,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        _say(f"JSON written to {args.json}")
    _say(f"total {total:.0f} s, logs in {log_dir}")
    if problems:
        print("\nFAILURES:", *problems, sep="\n  ")
        return 1
    return 0
