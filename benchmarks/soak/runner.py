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
    #: ``{sample: {"Name pid": bytes}}`` for the samples in ``rss``.
    rss_processes: dict[str, dict[str, int]] = field(default_factory=dict)
    rss_middle_phase: str = ""
    #: Anonymous (private, heap) part of ``rss``, per sample.
    rss_anon: dict[str, int] = field(default_factory=dict)
    plan_lines: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    log_path: str = ""
    error: str = ""
    server_pid: int = 0

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
    ctx = WorkloadContext(
        vocab_size(path),
        cfg.max_model_len,
        cfg.seed,
        cfg.request_seeds,
        cfg.large_max_tokens,
    )
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
            report.server_pid = handle.process.pid
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


def _exited(handle) -> Check:
    code = handle.process.returncode
    return Check("server alive", False, f"server exited with code {code}")


def _sample_rss(report: ModeReport, key: str, pid: int) -> int:
    processes = process_rss(pid)
    report.rss_processes[key] = processes
    report.rss[key] = sum(processes.values())
    report.rss_anon[key] = sum(process_rss(pid, "RssAnon").values())
    return report.rss[key]


def rss_by_role(report: ModeReport, sample: str) -> dict[str, int]:
    """RSS bytes of one sample by role: ``api_server`` (the process
    ``serve`` started), ``engine_core``, ``workers``, ``other`` (helpers)."""
    out = {"api_server": 0, "engine_core": 0, "workers": 0, "other": 0}
    for key, rss in report.rss_processes.get(sample, {}).items():
        name, _, pid = key.rpartition(" ")
        if int(pid) == report.server_pid:
            role = "api_server"
        elif name.startswith("VLLM::EngineCor"):
            role = "engine_core"
        elif name.startswith("VLLM::Worker"):
            role = "workers"
        else:
            role = "other"
        out[role] += rss
    return out


def rss_growth_by_role(report: ModeReport, first: str, last: str) -> dict[str, int]:
    """Bytes each role's processes grew between two samples."""
    a, b = rss_by_role(report, first), rss_by_role(report, last)
    return {role: b[role] - a[role] for role in b}


def _soak(cfg, report, handle, target, ctx, plan, pooled, log) -> None:
    probes = probe_specs(ctx, cfg.probes, cfg.probe_tokens)
    report.probes_start = run_probes(target, probes)
    start_idle = idle_kv(target, pooled, cfg.idle_timeout)
    check = _idle_check(start_idle, pooled)
    check.name = "idle KV = 0 at start"
    report.checks.append(check)
    _sample_rss(report, "start", handle.process.pid)
    stop_at = time.monotonic() + cfg.seconds
    for step in plan:
        jobs = make_jobs(ctx, step.name, step.requests, step.kind == "burst")
        threads = len(jobs) if step.kind == "burst" else cfg.concurrency
        phase = PhaseReport(step.name, step.kind, step.requests, threads)
        report.phases.append(phase)
        if time.monotonic() > stop_at:
            phase.skipped = len(jobs)
            continue
        if handle.process.poll() is not None:
            phase.skipped = len(jobs)
            phase.checks.append(_exited(handle))
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
        phase.rss_bytes = _sample_rss(report, phase.name, handle.process.pid)
        log(
            f"[{report.mode}] {phase.name}: {phase.sent} requests in "
            f"{phase.seconds:.0f}s {phase.counts} "
            f"{'ok' if phase.ok else 'FAILED'}"
        )
    if handle.process.poll() is not None:
        report.checks.append(_exited(handle))
        return
    report.probes_end = run_probes(target, probes)
    report.checks.append(same_tokens(report.probes_start, report.probes_end))
    report.checks.append(health(target))
    end_idle = idle_kv(target, pooled, cfg.idle_timeout)
    report.checks.append(_idle_check(end_idle, pooled))
    _sample_rss(report, "end", handle.process.pid)
    middle = report.rss.get(report.rss_middle_phase)
    if middle is None:
        report.checks.append(
            Check("RSS stable", False, "no middle sample (phases skipped)")
        )
    else:
        growth = (report.rss["end"] - middle) / MIB
        detail = (
            f"{growth:+.1f} MiB from {report.rss_middle_phase} to end "
            f"(bound < {cfg.rss_growth_mib:g} MiB)"
        )
        judged = cfg.requests >= cfg.rss_min_requests
        if not judged:
            detail += f"; not judged below {cfg.rss_min_requests} requests"
        ok = growth < cfg.rss_growth_mib or not judged
        report.checks.append(Check("RSS stable", ok, detail, judged))
        roles = rss_growth_by_role(report, report.rss_middle_phase, "end")
        flat = {r: roles[r] / MIB for r in ("api_server", "engine_core")}
        report.checks.append(
            Check(
                "API server and engine core RSS flat",
                max(flat.values()) < cfg.flat_process_mib,
                ", ".join(f"{r} {v:+.1f} MiB" for r, v in flat.items())
                + f" from {report.rss_middle_phase} to end "
                f"(bound < {cfg.flat_process_mib:g} MiB each)",
            )
        )
    problems = log_problems(handle.log_text())
    report.checks.append(
        Check("no error in server log", not problems, "; ".join(problems) or "none")
    )
