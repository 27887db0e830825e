"""One soak mode: start the server, run the phases, check after each, stop."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hybrid.tools.server import serve, shutdown_report, stop

from .checks import (
    Check,
    IdleKV,
    health,
    idle_kv,
    log_problems,
    process_rss,
    run_probes,
    same_tokens,
)
from .client import FAILURES, MetricsMonitor, Target, run_phase
from .config import MIB, MODES, SoakConfig, middle_phase, phase_plan
from .workload import WorkloadContext, make_jobs, probe_specs

#: Longest job (a conversation) in requests: bounds how long a phase may
#: wait for its last jobs after the time limit.
MAX_JOB_REQUESTS = 4


@dataclass
class PhaseReport:
    name: str
    kind: str
    planned: int
    threads: int
    counts: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    latency: dict[str, float] = field(default_factory=dict)
    unresolved: int = 0
    skipped: int = 0
    peaks: dict[str, float] = field(default_factory=dict)
    idle: IdleKV | None = None
    rss_bytes: int = 0
    checks: list[Check] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.counts.values())

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)


@dataclass
class ModeReport:
    mode: str
    model: str
    kv_cache_dtype: str
    config: dict
    startup_seconds: float = 0.0
    seconds: float = 0.0
    phases: list[PhaseReport] = field(default_factory=list)
    probes_start: list = field(default_factory=list)
    probes_end: list = field(default_factory=list)
    rss: dict[str, int] = field(default_factory=dict)
    rss_processes: dict[str, int] = field(default_factory=dict)
    rss_middle_phase: str = ""
    plan_lines: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    log_path: str = ""
    error: str = ""

    @property
    def all_checks(self) -> list[tuple[str, Check]]:
        out = [(phase.name, check) for phase in self.phases for check in phase.checks]
        return out + [("end", check) for check in self.checks]

    @property
    def ok(self) -> bool:
        return not self.error and all(check.ok for _, check in self.all_checks)

    def totals(self) -> Counter:
        total: Counter = Counter()
        for phase in self.phases:
            total.update(phase.counts)
        return total

    def to_json(self) -> dict:
        def plain(obj):
            if hasattr(obj, "__dataclass_fields__"):
                return {k: plain(v) for k, v in vars(obj).items()}
            if isinstance(obj, dict):
                return {str(k): plain(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [plain(v) for v in obj]
            return obj

        return plain(self)


def vocab_size(model_path: Path) -> int:
    config = json.loads((model_path / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def model_path(cfg: SoakConfig) -> Path:
    from vllm_hybrid.tools.tiny_models import build_tiny_model

    return Path(build_tiny_model(cfg.model_dir / cfg.model, cfg.model))


def _latency(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    ordered = sorted(seconds)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 3)}


def _phase_checks(phase: PhaseReport, cfg: SoakConfig, target: Target) -> None:
    counts = phase.counts
    checks = phase.checks
    checks.append(
        Check(
            "every request answered",
            phase.unresolved == 0,
            f"{phase.sent} answered, {phase.unresolved} still open at the bound",
        )
    )
    checks.append(
        Check("no 5xx", counts.get("5xx", 0) == 0, f"{counts.get('5xx', 0)} 5xx")
    )
    max_latency = phase.latency.get("max", 0.0)
    checks.append(
        Check(
            "no hang",
            counts.get("hang", 0) == 0 and max_latency <= cfg.request_timeout,
            f"{counts.get('hang', 0)} hung; slowest {max_latency:.1f}s "
            f"(bound {cfg.request_timeout:.0f}s)",
        )
    )
    other = {k: v for k, v in counts.items() if k in FAILURES - {"5xx", "hang"} and v}
    checks.append(Check("no other failure", not other, str(other or "none")))
    running = phase.peaks.get("running", 0.0)
    checks.append(
        Check(
            "running <= max-num-seqs",
            running <= cfg.max_num_seqs,
            f"peak running {running:.0f}, waiting {phase.peaks.get('waiting', 0):.0f}",
        )
    )
    checks.append(health(target))


def _idle_check(idle: IdleKV, pooled: bool) -> Check:
    gauges = "kv_pool_used_bytes{token,state}" if pooled else "kv_cache_usage_perc"
    values = ", ".join(f"{k} {v:g}" for k, v in idle.values.items())
    detail = f"{gauges} idle after {idle.waited:.1f}s: {values}"
    return Check(
        "idle KV = 0", idle.ok, detail if idle.ok else f"{detail}; {idle.detail}"
    )


def run_mode(cfg: SoakConfig, mode: str, log: callable = print) -> ModeReport:
    """Start a server in ``mode`` (``pooled`` or ``upstream``), soak it, stop it."""
    path = model_path(cfg)
    report = ModeReport(
        mode,
        cfg.model,
        cfg.kv_cache_dtype,
        {k: str(v) for k, v in vars(cfg).items()},
    )
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"soak-{cfg.model}-{mode}-{cfg.kv_cache_dtype}.log"
    report.log_path = str(log_file)
    env = dict(os.environ, VLLM_HYBRID_KV=MODES[mode])
    pooled = mode == "pooled"
    ctx = WorkloadContext(vocab_size(path), cfg.max_model_len, cfg.seed)
    plan = phase_plan(cfg)
    report.rss_middle_phase = middle_phase(plan)
    begin = time.monotonic()
    try:
        with serve(
            path,
            cfg.server_args(),
            log_path=log_file,
            env=env,
            ready_timeout=cfg.ready_timeout,
        ) as handle:
            report.startup_seconds = round(time.monotonic() - begin, 1)
            log(
                f"[{mode}] server ready in {report.startup_seconds:.0f}s; "
                f"log {log_file}"
            )
            report.plan_lines = [
                ln.split("] ", 1)[-1]
                for ln in handle.plan_lines()
                if "KV cache plan" in ln or "KV cache size" in ln
            ]
            target = Target(
                handle.url, handle.model, cfg.max_model_len, cfg.request_timeout
            )
            _soak(cfg, report, handle, target, ctx, plan, pooled, log)
            exit_code = stop(handle)
            shutdown = shutdown_report(handle, exit_code)
            report.checks.append(
                Check(
                    "clean shutdown",
                    shutdown.clean,
                    f"exit code {exit_code}; "
                    f"problems {list(shutdown.problems) or 'none'}",
                )
            )
    except (RuntimeError, TimeoutError, OSError) as err:
        report.error = f"{type(err).__name__}: {err}"[:2000]
    report.seconds = round(time.monotonic() - begin, 1)
    return report


def _soak(cfg, report, handle, target, ctx, plan, pooled, log) -> None:
    probes = probe_specs(ctx, cfg.probes, cfg.probe_tokens)
    report.probes_start = run_probes(target, probes)
    start_idle = idle_kv(target, pooled, cfg.idle_timeout)
    check = _idle_check(start_idle, pooled)
    check.name = "idle KV = 0 at start"
    report.checks.append(check)
    report.rss["start"] = sum(process_rss(handle.process.pid).values())
    stop_at = time.monotonic() + cfg.seconds
    for step in plan:
        jobs = make_jobs(ctx, step.name, step.requests)
        threads = len(jobs) if step.kind == "burst" else cfg.concurrency
        phase = PhaseReport(step.name, step.kind, step.requests, threads)
        report.phases.append(phase)
        if time.monotonic() > stop_at:
            phase.skipped = len(jobs)
            continue
        join_bound = (
            max(0.0, stop_at - time.monotonic())
            + MAX_JOB_REQUESTS * cfg.request_timeout
            + 30.0
        )
        with MetricsMonitor(target) as monitor:
            run = run_phase(target, jobs, threads, stop_at, join_bound)
        phase.peaks = dict(monitor.peaks)
        phase.seconds = round(run.seconds, 1)
        phase.unresolved, phase.skipped = run.unresolved, run.skipped
        phase.counts = dict(Counter(o.result for o in run.outcomes))
        phase.kinds = dict(Counter(o.kind for o in run.outcomes))
        phase.latency = _latency(
            [o.seconds for o in run.outcomes if o.result != "disconnected"]
        )
        phase.failures = [
            f"{o.rid} {o.kind} -> {o.result} {o.status}: {o.detail}"[:300]
            for o in run.outcomes
            if o.failed
        ][:5]
        _phase_checks(phase, cfg, target)
        phase.idle = idle_kv(target, pooled, cfg.idle_timeout)
        phase.checks.append(_idle_check(phase.idle, pooled))
        phase.rss_bytes = sum(process_rss(handle.process.pid).values())
        report.rss[phase.name] = phase.rss_bytes
        log(
            f"[{report.mode}] {phase.name}: {phase.sent} requests in "
            f"{phase.seconds:.0f}s {phase.counts} "
            f"{'ok' if phase.ok else 'FAILED'}"
        )
    report.probes_end = run_probes(target, probes)
    report.checks.append(same_tokens(report.probes_start, report.probes_end))
    report.checks.append(health(target))
    end_idle = idle_kv(target, pooled, cfg.idle_timeout)
    report.checks.append(_idle_check(end_idle, pooled))
    report.rss_processes = process_rss(handle.process.pid)
    report.rss["end"] = sum(report.rss_processes.values())
    middle = report.rss.get(report.rss_middle_phase)
    if middle is None:
        report.checks.append(
            Check("RSS stable", False, "no middle sample (phases skipped)")
        )
    else:
        growth = (report.rss["end"] - middle) / MIB
        report.checks.append(
            Check(
                "RSS stable",
                growth < cfg.rss_growth_mib,
                f"{growth:+.1f} MiB from {report.rss_middle_phase} to end "
                f"(bound < {cfg.rss_growth_mib:g} MiB)",
            )
        )
    problems = log_problems(handle.log_text())
    report.checks.append(
        Check("no error in server log", not problems, "; ".join(problems) or "none")
    )
