"""One worker process: one model in one mode (the overlay switch is read
once per process), its engines and workloads, one ``BENCH_RESULT`` line."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import tiny_model
from vllm_hybrid import plugin
from vllm_hybrid.tools.plan.geometry import KVGeometry, kv_geometry

from .config import NO_PREFIX_CACHING_KINDS, RESULT_PREFIX, BenchConfig
from .engine import Engine, EngineSpec, open_engine, start_error
from .same_tokens import preempt_budget_bytes, run_same_tokens
from .workloads import (
    longest_completing,
    one_long_metrics,
    run_many_short,
    run_multi_turn,
    run_one_long,
)

#: Workloads that run on the ``main`` engine, in this order.
MAIN_ENGINE_WORKLOADS: tuple[tuple[str, Callable[..., dict[str, Any]]], ...] = (
    ("many_short", run_many_short),
    ("multi_turn", run_multi_turn),
)


@dataclass
class WorkerReport:
    """Everything one worker process measured, printed as one JSON line."""

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
) -> dict[str, EngineSpec]:
    """The engines a worker in ``mode`` may need, by purpose."""
    pc = kind not in NO_PREFIX_CACHING_KINDS
    main = EngineSpec.from_config(model_path, cfg, pc, mode)
    one_long = replace(
        main,
        budget_bytes=cfg.one_long_budget_bytes,
        prefix_caching=False,
        max_num_seqs=1,
        max_model_len=cfg.one_long_max_model_len,
    )
    if cfg.one_long_block_size is not None:
        block = cfg.one_long_block_size
        one_long = replace(one_long, block_size=block, mamba_block_size=None)
    specs = {
        "main": main,
        "no_pc": replace(main, prefix_caching=False),
        "preempt": replace(
            main,
            budget_bytes=preempt_budget_bytes(cfg, kind),
            prefix_caching=False,
            max_num_seqs=cfg.preempt_max_num_seqs,
            max_model_len=cfg.same_tokens_max_model_len,
        ),
        "one_long_pc_off": one_long,
    }
    if pc:
        specs["one_long_pc_on"] = replace(one_long, prefix_caching=True)
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
    spec: EngineSpec,
    body: Callable[[Engine], None],
    start_error_is_result: bool = False,
) -> None:
    """Open one engine, run ``body`` on it, record start-up facts or errors
    (a start error is a result with ``start_error_is_result``: one_long)."""
    try:
        with open_engine(spec) as engine:
            report.engines[name] = {**engine.describe(), "spec": asdict(spec)}
            if report.geometry is None:
                geometry = kv_geometry(engine.scheduler.kv_cache_config)
                report.geometry = asdict(geometry)
            body(engine)
    except Exception as exc:
        if start_error_is_result and name not in report.engines:
            error = f"{type(exc).__name__}: {exc}"
            report.engines[name] = {"spec": asdict(spec), "start_error": error}
            return
        report.record_error(name, exc)


def _run_main_engine(
    report: WorkerReport, engine: Engine, cfg: BenchConfig, workloads: set[str]
) -> None:
    """many_short, multi_turn and same_tokens' prefix-caching pass share
    it."""
    for name, run in MAIN_ENGINE_WORKLOADS:
        if name not in workloads:
            continue
        result = _timed(report, name, lambda run=run: run(engine, cfg))
        if result is not None:
            result["engine"] = "main"
            report.workloads[name] = result
    if "same_tokens" in workloads and engine.spec.prefix_caching:
        _add_same_tokens(report, engine, cfg, "pc_on")


def _add_same_tokens(
    report: WorkerReport, engine: Engine, cfg: BenchConfig, *configs: str
) -> None:
    """Run same_tokens configurations and merge them into the report, each
    timed on its own (one that fails leaves the others' results)."""
    for config in configs:
        result = _timed(
            report, "same_tokens", lambda c=config: run_same_tokens(engine, cfg, c)
        )
        if result is None:
            continue
        result.pop("wall_s", None)
        merged = report.workloads.setdefault("same_tokens", {})
        merged.setdefault("configs", {}).update(result)
        merged["wall_s"] = sum(c["wall_s"] for c in merged["configs"].values())


#: Granularity of the max_model_len search when auto-fit is refused.
MAX_MODEL_LEN_STEP = 128


def startable_max_model_len(spec: EngineSpec, cap: int) -> tuple[int, int]:
    """Largest ``max_model_len`` (a multiple of the step) an engine refusing
    auto-fit accepts, or 0, and the number of probe starts."""

    def starts(k: int) -> bool:
        trial = replace(spec, max_model_len=k * MAX_MODEL_LEN_STEP)
        return start_error(trial) is None

    best, probed = longest_completing(starts, 1, cap // MAX_MODEL_LEN_STEP)
    return best * MAX_MODEL_LEN_STEP, len(probed)


def one_long_part(
    report: WorkerReport, name: str, spec: EngineSpec, cfg: BenchConfig
) -> dict[str, Any]:
    """One prefix-caching setting of one_long: start with auto-fit, else the
    largest startable ``max_model_len`` (none: 0 tokens), then search."""
    parts: dict[str, Any] = {}

    def body(engine: Engine) -> None:
        parts["result"] = run_one_long(engine, cfg)

    _with_engine(report, name, spec, body, start_error_is_result=True)
    first_error = report.engines.get(name, {}).get("start_error")
    fallback = None
    if first_error is not None and spec.max_model_len == -1:
        cap = cfg.one_long_search_cap + cfg.one_long_output
        max_len, probes = startable_max_model_len(spec, cap)
        fallback = {"max_model_len": max_len, "probe_starts": probes}
        if max_len:
            retry = replace(spec, max_model_len=max_len)
            report.engines.pop(name, None)
            _with_engine(report, name, retry, body, start_error_is_result=True)
    result = parts.get("result")
    started = report.engines.get(name, {})
    if result is None:
        geometry = KVGeometry(**report.geometry) if report.geometry else None
        result = one_long_metrics(None, cfg, geometry, 0, [], 0.0)
        last_error = started.get("start_error", first_error)
        result["metrics"]["engine_start_error"] = last_error
    result["metrics"]["auto_fit_refused"] = first_error is not None
    result["metrics"]["max_model_len"] = started.get("max_model_len")
    result["details"]["auto_fit_error"] = first_error
    result["details"]["max_model_len_fallback"] = fallback
    if first_error is not None and not started.get("start_error"):
        started["auto_fit_error"] = first_error
    return result


def _run_one_long(
    report: WorkerReport, specs: dict[str, EngineSpec], cfg: BenchConfig
) -> None:
    """One engine per prefix-caching setting."""
    parts: dict[str, Any] = {}
    start = time.perf_counter()
    for pc_name in ("pc_on", "pc_off"):
        name = f"one_long_{pc_name}"
        if name in specs:
            parts[pc_name] = one_long_part(report, name, specs[name], cfg)
    if parts:
        wall = time.perf_counter() - start
        report.workloads["one_long"] = {"parts": parts, "wall_s": wall}


def run_worker(
    model: str, model_dir: Path, workloads: list[str], cfg: BenchConfig, mode: str
):
    """Run the selected workloads for one model in ``mode`` (the overlay
    switch of this process matches it)."""
    report = WorkerReport(model=model, mode=mode)
    try:
        import vllm

        report.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        path = str(tiny_model(model, model_dir))
        specs = engine_specs(path, model, cfg, mode)
        selected = set(workloads)
        main_engine = {name for name, _ in MAIN_ENGINE_WORKLOADS} | {"same_tokens"}
        if selected & main_engine:
            _with_engine(
                report,
                "main",
                specs["main"],
                lambda e: _run_main_engine(report, e, cfg, selected),
            )
        if "same_tokens" in selected and cfg.same_tokens_uncached:
            for name, configs in (
                ("no_pc", ("pc_off", "alone")),
                ("preempt", ("preempt",)),
            ):
                _with_engine(
                    report,
                    name,
                    specs[name],
                    lambda e, cs=configs: _add_same_tokens(report, e, cfg, *cs),
                )
        if "same_tokens" in selected:
            import torch

            same = report.workloads.setdefault("same_tokens", {})
            same["omp_threads"] = torch.get_num_threads()
        if "one_long" in selected:
            _run_one_long(report, specs, cfg)
    except Exception as exc:
        report.record_error("worker", exc)
    state = plugin.state()  # None: the overlay was never activated here
    report.overlay_active = state.active if state else None
    report.overlay_state = state.reason if state else "not activated"
    print(RESULT_PREFIX + json.dumps(asdict(report)), flush=True)
    return report
