"""One server per model x dtype x mode: start it, warm it up, drive every
rate with vLLM's serving benchmark, read ``/metrics`` around and during each
rate, stop it."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import server_args, tiny_model
from testing.loopback import (
    POOL_USED,
    PREEMPTIONS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    RUNNING,
    Metrics,
    mode_env,
    read_log,
    scrape,
    serve,
    shutdown_report,
)

from .config import UPSTREAM_CPU_DTYPES, BenchConfig, rate_key, warmup

Log = Callable[[str], None]

#: What vLLM's result keeps per rate (its per-request lists stay out).
BENCH_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    *(f"p{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in (50, 90, 99)),
)


@dataclass
class RateRun:
    """One rate on one server: vLLM's numbers and the server's."""

    rate: str
    #: Flat numbers: :data:`BENCH_KEYS`, then ``prefix_hit_rate``,
    #: ``preemptions`` (counter deltas), ``peak_running`` and
    #: ``peak_<pool>_used_bytes`` (read every ``metrics_interval``).
    values: dict[str, float | None]
    errors: list[str] = field(default_factory=list)


@dataclass
class ServerResult:
    """One server. ``status``: ``ok``; ``failed`` (did not start, a request
    failed, or it died); ``not_run`` (upstream cannot store the dtype)."""

    model: str
    mode: str
    dtype: str
    status: str = "ok"
    reason: str = ""
    #: The server's "KV cache size" log line.
    capacity: str = ""
    log_path: str = ""
    clean_shutdown: bool | None = None
    runs: list[RateRun] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.model} {self.mode} {self.dtype}"


def counter_deltas(before: Metrics, after: Metrics) -> dict[str, float | None]:
    """Prefix-cache hit rate (tokens) and preemptions between two reads."""
    queries = after.total(PREFIX_QUERIES) - before.total(PREFIX_QUERIES)
    hits = after.total(PREFIX_HITS) - before.total(PREFIX_HITS)
    return {
        "prefix_hit_rate": hits / queries if queries > 0 else None,
        "preemptions": after.total(PREEMPTIONS) - before.total(PREEMPTIONS),
    }


def peaks_of(metrics: Metrics, peaks: dict[str, float]) -> None:
    """Fold one read into the peaks of running requests and pool bytes."""
    values = {"peak_running": metrics.total(RUNNING)}
    for pool, used in metrics.by(POOL_USED, "pool").items():
        values[f"peak_{pool}_used_bytes"] = used
    for key, value in values.items():
        peaks[key] = max(peaks.get(key, 0.0), value)


async def _with_peaks(cfg: BenchConfig, url: str, args: list[str]) -> tuple:
    """vLLM's benchmark with ``/metrics`` read alongside, in one loop."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    peaks: dict[str, float] = {}
    done = asyncio.Event()

    async def read() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                peaks_of(await asyncio.to_thread(scrape, url), peaks)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), cfg.metrics_interval)

    reader = asyncio.create_task(read())
    try:
        return await main_async(parser.parse_args(args)), peaks
    finally:
        done.set()
        await reader


def bench(cfg: BenchConfig, url: str, model: str, rate: float, out) -> RateRun:
    """One rate: counters before, vLLM's benchmark (its printout to ``out``),
    counters after."""
    before = scrape(url)
    with contextlib.redirect_stdout(out):
        result, peaks = asyncio.run(
            _with_peaks(cfg, url, cfg.bench_args(url, model, rate))
        )
    values = {key: result.get(key) for key in BENCH_KEYS}
    values |= counter_deltas(before, scrape(url)) | peaks
    errors = [e for e in result.get("errors", []) if e]
    return RateRun(rate_key(rate), values, errors[:5])


def run_server(
    cfg: BenchConfig, model: str, mode: str, dtype: str, log_dir: Path, log: Log
) -> ServerResult:
    """Never raises for a server problem: the result says what happened."""
    log_path = log_dir / f"{model}-{mode}-{dtype}.log"
    result = ServerResult(model, mode, dtype, log_path=str(log_path))
    log(f"{result.name}: starting server (log {log_path})")
    handle = None
    try:
        with (
            serve(
                tiny_model(model, cfg.model_dir),
                server_args(cfg, dtype),
                log_path=log_path,
                env=mode_env(mode),
            ) as handle,
            open(log_dir / f"{model}-{mode}-{dtype}.bench.log", "w") as out,
        ):
            lines = [x for x in handle.plan_lines() if "KV cache size" in x]
            result.capacity = lines[0].split("] ", 1)[-1] if lines else ""
            bench(warmup(cfg), handle.url, handle.model, float("inf"), out)
            for rate in cfg.rates:
                run = bench(cfg, handle.url, handle.model, rate, out)
                result.runs.append(run)
                log(f"  {run.rate:>4} req/s: {run.values['completed']} done")
                if run.errors or run.values["failed"]:
                    result.status = "failed"
                    result.reason = f"requests failed at {run.rate}: {run.errors[:1]}"
                    break
            if handle.process.poll() is not None:
                result.status = "failed"
                result.reason = f"server exited with code {handle.process.returncode}"
    except (RuntimeError, OSError, ValueError) as err:
        result.status = "failed"
        result.reason = (str(err) or type(err).__name__).splitlines()[0]
    if handle is not None:
        result.clean_shutdown = shutdown_report(handle, handle.process.returncode).clean
    if result.status != "ok" and log_path.exists():
        result.reason += f" | log: {read_log(log_path.read_text()).cause}"
    return result


def run_all(cfg: BenchConfig, log: Log) -> tuple[list[ServerResult], Path]:
    """Models in order; within a model the dtypes in order with both modes
    back to back (the two runs of a comparison see the machine in the same
    state, as far as possible)."""
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for model in cfg.models:
        for dtype in cfg.dtypes:
            for mode in cfg.modes:
                if mode == "upstream" and dtype not in UPSTREAM_CPU_DTYPES:
                    reason = "upstream's CPU attention stores auto and fp8 only"
                    results.append(ServerResult(model, mode, dtype, "not_run", reason))
                else:
                    results.append(run_server(cfg, model, mode, dtype, log_dir, log))
    return results, log_dir
