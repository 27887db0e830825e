"""One worker process: one model in one mode (the overlay switch is read
once per process), its engines and workloads, its report as JSON."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import tiny_model
from vllm_hybrid import plugin
from vllm_hybrid.tools.plan.geometry import kv_geometry

from .admission import run_admission
from .config import NO_PREFIX_CACHING_KINDS, BenchConfig
from .engine import Engine, engine_kwargs, open_engine
from .workloads import run_many_short, run_one_long


@dataclass
class WorkerReport:
    """Everything one worker process measured, written as JSON."""

    model: str
    mode: str
    overlay_active: bool | None = None
    overlay_state: str = ""
    vllm_version: str = ""
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Bytes per token / per request of the model (same in both modes).
    geometry: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    #: where -> traceback text (tail), for the driver to print.
    tracebacks: dict[str, str] = field(default_factory=dict)

    def record_error(self, where: str, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append(f"{where}: {type(exc).__name__}: {exc}")
        key, n = where, 1
        while key in self.tracebacks:
            n += 1
            key = f"{where}#{n}"
        self.tracebacks[key] = text[-4000:]


def engine_specs(
    model_path: str, kind: str, cfg: BenchConfig, mode: str = "overlay"
) -> dict[str, dict[str, Any]]:
    """The ``vllm.LLM`` arguments of the engines a worker in ``mode`` may
    need, by purpose: ``main`` (many_short), ``admission`` (main's at its
    own block size) and one_long's, one sequence at its own budget,
    ``max_model_len`` auto-fitted to it (-1, the only setting upstream starts
    with at 5 MiB) and its own block size."""
    pc = kind not in NO_PREFIX_CACHING_KINDS
    main = engine_kwargs(model_path, cfg, pc, mode)
    one_long = {
        **main,
        "kv_cache_memory_bytes": cfg.one_long_budget_bytes,
        "enable_prefix_caching": False,
        "max_num_seqs": 1,
        "max_model_len": -1,
    }
    one_long.pop("mamba_block_size", None)
    if cfg.one_long_block_size is not None:
        one_long["block_size"] = cfg.one_long_block_size
    admission = {**main}
    if cfg.admission_block_size is not None:
        admission["block_size"] = cfg.admission_block_size
    specs = {"main": main, "admission": admission, "one_long_pc_off": one_long}
    if pc:
        specs["one_long_pc_on"] = {**one_long, "enable_prefix_caching": True}
    return specs


def _timed(report: WorkerReport, name: str, fn: Callable[[], dict]) -> dict | None:
    """Run one workload piece, recording its result or its exception."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        report.record_error(name, exc)
        return None
    result.setdefault("wall_s", time.perf_counter() - start)
    return result


def _with_engine(
    report: WorkerReport,
    name: str,
    kwargs: dict[str, Any],
    body: Callable[[Engine], None],
) -> None:
    """Open one engine, run ``body`` on it, record start-up facts or errors
    (an engine that does not start is an error like any other)."""
    try:
        with open_engine(kwargs) as engine:
            report.engines[name] = {**engine.describe(), "spec": kwargs}
            if report.geometry is None:
                geometry = kv_geometry(engine.scheduler.kv_cache_config)
                report.geometry = asdict(geometry)
            body(engine)
    except Exception as exc:
        report.record_error(name, exc)


def _run_one_long(
    report: WorkerReport, specs: dict[str, dict[str, Any]], cfg: BenchConfig
) -> None:
    """One engine per prefix-caching setting."""
    parts: dict[str, Any] = {}
    start = time.perf_counter()
    for pc_name in ("pc_on", "pc_off"):
        name = f"one_long_{pc_name}"
        if name in specs:

            def search(engine: Engine, part: str = pc_name) -> None:
                parts[part] = run_one_long(engine, cfg)

            _with_engine(report, name, specs[name], search)
    if parts:
        wall = time.perf_counter() - start
        report.workloads["one_long"] = {"parts": parts, "wall_s": wall}


def run_worker(
    model: str, model_dir: Path, workloads: list[str], cfg: BenchConfig, mode: str
) -> WorkerReport:
    """Run the selected workloads for one model in ``mode`` (the overlay
    switch of this process matches it)."""
    report = WorkerReport(model=model, mode=mode)
    try:
        import vllm

        report.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        path = str(tiny_model(model, model_dir))
        specs = engine_specs(path, model, cfg, mode)
        selected = set(workloads)
        if "many_short" in selected:

            def many_short(engine: Engine) -> None:
                run = _timed(report, "many_short", lambda: run_many_short(engine, cfg))
                if run is not None:
                    report.workloads["many_short"] = run

            _with_engine(report, "main", specs["main"], many_short)
        if "one_long" in selected:
            _run_one_long(report, specs, cfg)
        if "admission" in selected:

            def admission(engine: Engine) -> None:
                run = _timed(report, "admission", lambda: run_admission(engine, cfg))
                if run is not None:
                    report.workloads["admission"] = run

            _with_engine(report, "admission", specs["admission"], admission)
    except Exception as exc:
        report.record_error("worker", exc)
    state = plugin.state()  # None: the overlay was never activated here
    report.overlay_active = state.active if state else None
    report.overlay_state = state.reason if state else "not activated"
    return report


def worker_main(in_path: str, out_path: str) -> int:
    """A worker process (``bench_pooled.py --worker IN OUT``, started by the
    driver): the model, mode, workloads and settings in ``IN``, its report
    written to ``OUT``."""
    job = json.loads(Path(in_path).read_text())
    cfg = BenchConfig(**job["config"])
    model_dir = Path(job["model_dir"])
    report = run_worker(job["model"], model_dir, job["workloads"], cfg, job["mode"])
    Path(out_path).write_text(json.dumps(asdict(report)))
    return 1 if report.errors else 0
