"""One server per model x dtype x mode: start it, warm it up, run every rate,
stop it, and keep what it reported."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from vllm_hybrid.tools.server import ServerHandle, serve, shutdown_report

from .client import run_load
from .config import MODES, BenchConfig, rate_key, rate_label
from .metrics import RunSummary, summarize
from .probe import UpstreamDtypeProbe
from .workload import (
    PlannedRequest,
    max_prompt_tokens,
    ordinary_token_ids,
    plan_run,
    plan_warmup,
)

Log = Callable[[str], None]

#: An exception line of a traceback: ``ValueError: ...``, ``x.y.FooError: ...``.
EXCEPTION_LINE = re.compile(r"\b[\w.]*(Error|Exception|Interrupt): ")
#: Raised in the API server for every request once the engine core died;
#: the engine core's own exception, logged before it, is the cause.
CONSEQUENCE = "EngineDeadError"
#: A process that crashed: what it logged is the cause, the exceptions of
#: the processes around it are consequences.
CRASH_MARKERS = ("Segfault encountered", "Segmentation fault", "Fatal Python error")
#: Fallback markers, most telling first.
REASON_MARKERS = ("died unexpectedly", "exited with code", " ERROR ", "Traceback")


@dataclass
class ServerResult:
    """One server. ``status``: ``ok``; ``failed`` (did not start, a request
    failed, or it died); ``not_runnable`` (not started, or an expected
    failure of a configuration upstream cannot serve)."""

    model: str
    mode: str
    dtype: str
    status: str = "ok"
    reason: str = ""
    startup_s: float = 0.0
    plan_lines: list[str] = field(default_factory=list)
    log_path: str = ""
    runs: list[RunSummary] = field(default_factory=list)
    #: Per rate key, every request (offsets, TTFT, latency, tokens, error).
    requests: dict[str, list[dict]] = field(default_factory=dict)
    shutdown: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model} {self.mode} {self.dtype}"

    def run(self, rate: str) -> RunSummary | None:
        return next((r for r in self.runs if r.rate == rate), None)

    def to_json(self) -> dict:
        out = asdict(self)
        out["runs"] = [asdict(run) for run in self.runs]
        return out


def _crash_line(lines: list[str]) -> str | None:
    """A crash marker and the first frame below it outside libc's signal
    handling (the C++ function that crashed)."""
    for i, line in enumerate(lines):
        if any(marker in line for marker in CRASH_MARKERS):
            frames = [
                x
                for x in lines[i + 1 : i + 6]
                if x.startswith("File ") and "sysdeps" not in x
            ]
            return (line + (f" {frames[0]}" if frames else ""))[:240]
    return None


def reason_line(log_text: str, fallback: str) -> str:
    """The one log line that best says what went wrong (pure, for tests).

    A crash, else the first exception raised in an error record or a bare
    traceback, not counting the API server's ``EngineDeadError`` for a dead
    engine (warnings may mention exceptions they did not raise), else the
    first line with a fallback marker, else ``fallback``'s first line.
    """
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    crash = _crash_line(lines)
    if crash:
        return crash
    errors = [line for line in lines if " ERROR " in line or not line.startswith("(")]
    for line in errors:
        if EXCEPTION_LINE.search(line) and CONSEQUENCE not in line:
            return line[:240]
    for marker in REASON_MARKERS:
        hits = [line for line in lines if marker in line]
        if hits:
            return hits[0][:240]
    return fallback.strip().splitlines()[0][:240] if fallback.strip() else "unknown"


def _log_dir(cfg: BenchConfig) -> Path:
    path = cfg.log_dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _drive(
    cfg: BenchConfig,
    handle: ServerHandle,
    result: ServerResult,
    warmup: list[PlannedRequest],
    plans: dict[float, list[PlannedRequest]],
    log: Log,
) -> None:
    """Warm-up, then each rate in order; stop at the first failed run (a
    dead server would fail every later one too)."""
    warm = run_load(handle.url, handle.model, warmup, cfg.request_timeout)
    bad = [r.error for r in warm.records if r.error]
    if bad:
        result.status, result.reason = "failed", f"warm-up request failed: {bad[0]}"
        return
    for rate, planned in plans.items():
        load = run_load(
            handle.url, handle.model, planned, cfg.request_timeout, cfg.metrics_interval
        )
        summary = summarize(
            rate_key(rate),
            load.records,
            load.duration_s,
            load.before,
            load.after,
            load.peaks,
        )
        result.runs.append(summary)
        result.requests[rate_key(rate)] = [asdict(r) for r in load.records]
        log(
            f"  {rate_label(rate):>12}: {summary.completed}/{summary.requests} done, "
            f"{summary.output_tok_per_s:.1f} tok/s, {summary.duration_s:.1f} s"
        )
        if summary.errors:
            result.status = "failed"
            result.reason = f"{summary.errors} requests failed at {rate_label(rate)}: "
            result.reason += summary.first_errors[0]
            return


def run_server(
    cfg: BenchConfig,
    model: str,
    mode: str,
    dtype: str,
    model_path: Path,
    plans: dict[float, list[PlannedRequest]],
    warmup: list[PlannedRequest],
    log_dir: Path,
    log: Log,
) -> ServerResult:
    """Never raises for a server problem: the result says what happened."""
    result = ServerResult(model, mode, dtype)
    log_path = log_dir / f"{model}-{mode}-{dtype}.log"
    result.log_path = str(log_path)
    env = dict(os.environ, VLLM_HYBRID_KV=MODES[mode])
    log(f"{result.name}: starting server (log {log_path})")
    started = time.perf_counter()
    handle: ServerHandle | None = None
    try:
        with serve(
            model_path,
            cfg.server_args(dtype),
            log_path=log_path,
            env=env,
            ready_timeout=cfg.ready_timeout,
        ) as handle:
            result.startup_s = time.perf_counter() - started
            result.plan_lines = handle.plan_lines()
            _drive(cfg, handle, result, warmup, plans, log)
            if handle.process.poll() is not None:
                result.status = "failed"
                result.reason = f"server exited with code {handle.process.returncode}"
    except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as err:
        # Start failures, and /metrics reads of a server that died.
        result.status = "failed"
        result.reason = (str(err) or type(err).__name__).splitlines()[0]
    if handle is not None and handle.process.returncode is not None:
        report = shutdown_report(handle, handle.process.returncode)
        result.shutdown = {
            "exit_code": report.exit_code,
            "clean": report.clean,
            "problems": list(report.problems),
        }
    if result.status != "ok" and log_path.exists():
        text = log_path.read_text(errors="replace")
        result.reason += f" | log: {reason_line(text, result.reason)}"
    return result


def _check_shape(cfg: BenchConfig) -> None:
    need = max_prompt_tokens(cfg.load)
    if need > cfg.max_model_len:
        raise SystemExit(
            f"bench_serve: prompts + outputs reach {need} tokens, above "
            f"--max-model-len {cfg.max_model_len}"
        )


def _needs_probe(cfg: BenchConfig) -> list[str]:
    if "upstream" not in cfg.modes:
        return []
    return [d for d in cfg.dtypes if d != "auto"]


def _upstream_verdict(
    cfg: BenchConfig, probe: UpstreamDtypeProbe | None, dtype: str
) -> tuple[bool, str]:
    """(start it, why upstream cannot store it): the probe's "no" skips the
    server unless forced; a failed probe starts it (the server decides)."""
    if probe is None or dtype == "auto":
        return True, ""
    verdict = probe.verdict(dtype)
    if verdict.supported is False:
        return cfg.force_upstream_turboquant, verdict.reason
    return True, ""


def run_all(cfg: BenchConfig, log: Log) -> tuple[list[ServerResult], dict, Path]:
    """Every server of the invocation, models in order, and within a model
    the dtypes in order with both modes back to back (so the two runs of a
    comparison see the machine in the same state, as far as possible)."""
    from vllm_hybrid.tools.tiny_models import build_tiny_model

    _check_shape(cfg)
    log_dir = _log_dir(cfg)
    probe_dtypes = _needs_probe(cfg)
    probe = (
        UpstreamDtypeProbe(probe_dtypes, log_dir / "upstream-dtype-probe.log")
        if probe_dtypes
        else None
    )
    results: list[ServerResult] = []
    try:
        for model in cfg.models:
            path = Path(build_tiny_model(cfg.model_dir / model, model))
            vocab = ordinary_token_ids(path)
            plans = {
                rate: plan_run(cfg.load, vocab, cfg.seed, rate) for rate in cfg.rates
            }
            warmup = plan_warmup(vocab, cfg.seed, cfg.warmup_requests)
            for dtype in cfg.dtypes:
                for mode in cfg.modes:
                    results.append(
                        _one(
                            cfg,
                            model,
                            mode,
                            dtype,
                            path,
                            plans,
                            warmup,
                            log_dir,
                            probe,
                            log,
                        )
                    )
        verdicts = {d: asdict(probe.verdict(d)) for d in probe_dtypes} if probe else {}
    finally:
        if probe is not None:
            probe.close()
    return results, verdicts, log_dir


def _one(
    cfg: BenchConfig,
    model: str,
    mode: str,
    dtype: str,
    path: Path,
    plans: dict[float, list[PlannedRequest]],
    warmup: list[PlannedRequest],
    log_dir: Path,
    probe: UpstreamDtypeProbe | None,
    log: Log,
) -> ServerResult:
    note = ""
    if mode == "upstream":
        start, note = _upstream_verdict(cfg, probe, dtype)
        if not start:
            log(f"{model} upstream {dtype}: not runnable upstream on CPU: {note}")
            return ServerResult(
                model,
                mode,
                dtype,
                status="not_runnable",
                reason=f"not runnable upstream on CPU: {note}",
            )
    result = run_server(cfg, model, mode, dtype, path, plans, warmup, log_dir, log)
    if note and result.status == "failed":
        # Forced past the probe's verdict: the failure is the expected one.
        result.status = "not_runnable"
        result.reason = f"not runnable upstream on CPU: {note}; {result.reason}"
    elif note:
        result.reason = f"forced although unsupported upstream: {note}"
    return result
