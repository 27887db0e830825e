"""One soak mode: start the server, run the phases, check after each, hold a
queue open, probe, stop."""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

from benchmarks.harness import MIB, server_args, tiny_model
from testing.loopback import (
    PREEMPTIONS,
    ServerHandle,
    held_requests,
    mode_env,
    read_log,
    request,
    scrape,
    serve,
    shutdown_report,
    stop,
    wait_idle,
)
from vllm_hybrid.tools.greedy import first_difference

from .client import FAILURES, Target, run_phase, submit
from .config import SoakConfig, middle_phase, phase_plan
from .workload import WorkloadContext, make_jobs, probe_specs

ROLES = ("api_server", "engine_core", "workers", "other")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    #: False: measured and reported, but the run was too short to judge it.
    judged: bool = True


@dataclass
class PhaseReport:
    name: str
    kind: str
    threads: int
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    #: Request latency p50 and max, seconds (disconnects left out).
    latency: dict[str, float] = field(default_factory=dict)
    #: ``vllm:num_preemptions_total`` at the end of the phase.
    preemptions: float = 0.0
    #: :meth:`Metrics.kv_in_use` once idle after the phase.
    idle: dict[str, float] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.counts.values())


@dataclass
class ModeReport:
    mode: str
    model: str
    kv_cache_dtype: str
    config: dict
    startup_seconds: float = 0.0
    seconds: float = 0.0
    phases: list[PhaseReport] = field(default_factory=list)
    #: :meth:`Metrics.kv_in_use` while ``max_num_seqs + held_extra`` long
    #: requests were held open.
    held: dict[str, float] = field(default_factory=dict)
    probes_start: list = field(default_factory=list)
    probes_end: list = field(default_factory=list)
    #: RSS bytes per sample (after a phase, ``start``, ``end``) and role.
    rss: dict[str, dict[str, int]] = field(default_factory=dict)
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
        return sum((Counter(p.counts) for p in self.phases), Counter())

    def growth(self, first: str, last: str) -> dict[str, int]:
        """Bytes each role's processes grew between two RSS samples."""
        a, b = self.rss.get(first, {}), self.rss.get(last, {})
        return {role: b.get(role, 0) - a.get(role, 0) for role in ROLES}


def rss_sample(pid: int) -> dict[str, int]:
    """RSS bytes of the server process tree by role: ``api_server`` (the
    process ``serve`` started), ``engine_core``, ``workers``, ``other``."""
    root = psutil.Process(pid)
    roles = dict.fromkeys(ROLES, 0)
    for proc in [root, *root.children(recursive=True)]:
        try:
            name, rss = proc.name(), proc.memory_info().rss
        except psutil.Error:
            continue
        role = "api_server" if proc.pid == pid else "other"
        role = "engine_core" if name.startswith("VLLM::EngineCor") else role
        roles["workers" if name.startswith("VLLM::Worker") else role] += rss
    return roles


def same_tokens(start: list, end: list) -> Check:
    """The probes' greedy tokens at the end against those at the start."""
    equal = sum(
        isinstance(a, list) and a == b for a, b in zip(start, end, strict=False)
    )
    diffs = []
    for i, (a, b) in enumerate(zip(start, end, strict=False)):
        if a != b and isinstance(a, list) and isinstance(b, list):
            diffs.append(f"probe {i} differs at token {first_difference(a, b)}")
        elif a != b:
            diffs.append(f"probe {i}: {a if isinstance(a, str) else b}")
    detail = "; ".join([f"{equal}/{len(start)} probes", *diffs])
    return Check("greedy same tokens", equal == len(start) == len(end), detail)


def _probes(target: Target, specs) -> list[list[int] | str]:
    """Each probe alone (batch-independent): its token ids, or the error."""
    out: list[list[int] | str] = []
    for spec in specs:
        o = submit(target, spec)
        ok = o.result == "ok" and o.token_ids is not None
        out.append(list(o.token_ids) if ok else f"{o.result} {o.status}: {o.detail}")
    return out


def _health(url: str) -> Check:
    try:
        status = request(url + "/health", timeout=30.0)[0]
    except OSError as err:
        return Check("health", False, repr(err))
    return Check("health", status == 200, f"/health {status}")


def _idle(url: str, pooled: bool, name: str = "idle KV = 0") -> tuple[Check, dict]:
    """No request and no KV block in use once idle (both pools' used bytes in
    pooled mode, vLLM's usage gauge); a value that stays above 0 is a leak."""
    values = wait_idle(url)
    missing = pooled and not {"token_used_bytes", "state_used_bytes"} <= set(values)
    detail = ", ".join(f"{k} {v:g}" for k, v in values.items())
    detail += "; no per-pool gauges" if missing else ""
    return Check(name, not missing and not any(values.values()), detail), values


def _held(cfg: SoakConfig, target: Target, pooled: bool) -> tuple[Check, dict]:
    """``max_num_seqs + held_extra`` long requests held open: at most
    ``max_num_seqs`` run, the rest wait, KV memory (both pools) in use."""
    count = cfg.max_num_seqs + cfg.held_extra
    with held_requests(target.url, target.model, count) as metrics:
        held = metrics.kv_in_use()
    busy = (
        ("token_used_bytes", "state_used_bytes") if pooled else ("kv_cache_usage_perc",)
    )
    ok = 1 <= held["running"] <= cfg.max_num_seqs
    ok = ok and held["running"] + held["waiting"] == count
    ok = ok and all(held.get(key, 0) > 0 for key in busy)
    name = f"{count} held: <= max-num-seqs run, the rest wait, KV in use"
    return Check(name, ok, ", ".join(f"{k} {v:g}" for k, v in held.items())), held


def _phase(cfg: SoakConfig, target: Target, jobs, step, pooled: bool) -> PhaseReport:
    burst = step.kind == "burst"
    phase = PhaseReport(step.name, step.kind, len(jobs) if burst else cfg.concurrency)
    began = time.monotonic()
    outcomes = run_phase(target, jobs, phase.threads)
    phase.seconds = round(time.monotonic() - began, 1)
    counts = Counter(o.result for o in outcomes)
    phase.counts, phase.kinds = dict(counts), dict(Counter(o.kind for o in outcomes))
    seconds = [o.seconds for o in outcomes if o.result != "disconnected"]
    if seconds:
        phase.latency = {"p50": float(np.median(seconds)), "max": max(seconds)}
    phase.failures = [
        f"{o.rid} {o.kind} -> {o.result} {o.status}: {o.detail}"[:300]
        for o in outcomes
        if o.failed
    ][:5]
    other = {k: v for k, v in counts.items() if k in FAILURES - {"5xx", "hang"}}
    idle, phase.idle = _idle(target.url, pooled)
    phase.checks = [
        Check("no 5xx", not counts["5xx"], f"{counts['5xx']} 5xx"),
        Check("no hang", not counts["hang"], f"{counts['hang']} unanswered"),
        Check("no other failure", not other, str(other or "none")),
        _health(target.url),
        idle,
    ]
    phase.preemptions = scrape(target.url).total(PREEMPTIONS)
    return phase


def _rss_checks(cfg: SoakConfig, report: ModeReport) -> list[Check]:
    middle = report.rss_middle_phase
    if middle not in report.rss:
        return [Check("RSS stable", False, "no middle sample")]
    growth = report.growth(middle, "end")
    total = sum(growth.values()) / MIB
    judged = cfg.requests >= cfg.rss_min_requests
    detail = f"{total:+.1f} MiB from {middle} to end (bound < {cfg.rss_growth_mib:g})"
    detail += "" if judged else f"; not judged below {cfg.rss_min_requests} requests"
    flat = {role: growth[role] / MIB for role in ("api_server", "engine_core")}
    return [
        Check("RSS stable", total < cfg.rss_growth_mib or not judged, detail, judged),
        Check(
            "API server and engine core RSS flat",
            max(flat.values()) < cfg.flat_process_mib,
            ", ".join(f"{r} {v:+.1f} MiB" for r, v in flat.items())
            + f" (bound < {cfg.flat_process_mib:g} MiB each)",
        ),
    ]


def _soak(cfg, report, handle: ServerHandle, ctx, log) -> None:
    pooled, pid = report.mode == "pooled", handle.process.pid
    target = Target(handle.url, handle.model, cfg.max_model_len, cfg.request_timeout)
    probes = probe_specs(ctx, cfg.probes, cfg.probe_tokens)
    report.probes_start = _probes(target, probes)
    report.checks.append(_idle(handle.url, pooled, "idle KV = 0 at start")[0])
    report.rss["start"] = rss_sample(pid)
    for step in phase_plan(cfg):
        if handle.process.poll() is not None:
            break
        jobs = make_jobs(ctx, step.name, step.requests, step.kind == "burst")
        phase = _phase(cfg, target, jobs, step, pooled)
        report.phases.append(phase)
        report.rss[phase.name] = rss_sample(pid)
        ok = all(c.ok for c in phase.checks)
        log(
            f"[{report.mode}] {phase.name}: {phase.sent} requests in "
            f"{phase.seconds:.0f}s {phase.counts} {'ok' if ok else 'FAILED'}"
        )
    if handle.process.poll() is not None:
        code = handle.process.returncode
        report.checks.append(Check("server alive", False, f"exited with code {code}"))
        return
    check, report.held = _held(cfg, target, pooled)
    report.checks.append(check)
    report.checks.append(_idle(handle.url, pooled, "idle KV = 0 after held")[0])
    report.probes_end = _probes(target, probes)
    report.checks.append(same_tokens(report.probes_start, report.probes_end))
    report.checks.append(_health(handle.url))
    report.rss["end"] = rss_sample(pid)
    report.checks += _rss_checks(cfg, report)
    serving = read_log(handle.log_text()).while_serving
    report.checks.append(
        Check("no error in server log", not serving, "; ".join(serving) or "none")
    )


def vocab_size(model_path: Path) -> int:
    config = json.loads((model_path / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def run_mode(
    cfg: SoakConfig, mode: str, log: Callable[[str], None] = print
) -> ModeReport:
    """Start a server in ``mode`` (``pooled`` or ``upstream``), soak it, stop it."""
    path = tiny_model(cfg.model, cfg.model_dir)
    report = ModeReport(
        mode, cfg.model, cfg.kv_cache_dtype, {k: str(v) for k, v in asdict(cfg).items()}
    )
    report.rss_middle_phase = middle_phase(phase_plan(cfg))
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"soak-{cfg.model}-{mode}-{cfg.kv_cache_dtype}.log"
    report.log_path = str(log_file)
    ctx = WorkloadContext(
        vocab_size(path),
        cfg.max_model_len,
        cfg.seed,
        cfg.request_seeds,
        cfg.large_max_tokens,
    )
    begin = time.monotonic()
    try:
        with serve(
            path,
            server_args(cfg, cfg.kv_cache_dtype),
            log_path=log_file,
            env=mode_env(mode),
            ready_timeout=cfg.ready_timeout,
        ) as handle:
            report.startup_seconds = round(time.monotonic() - begin, 1)
            log(f"[{mode}] ready in {report.startup_seconds:.0f}s; log {log_file}")
            report.plan_lines = [
                line.split("] ", 1)[-1]
                for line in handle.plan_lines()
                if "KV cache plan" in line or "KV cache size" in line
            ]
            _soak(cfg, report, handle, ctx, log)
            shutdown = shutdown_report(handle, stop(handle))
            problems = list(shutdown.problems) or "none"
            detail = f"exit code {shutdown.exit_code}; problems {problems}"
            report.checks.append(Check("clean shutdown", shutdown.clean, detail))
    except (RuntimeError, OSError) as err:
        report.error = f"{type(err).__name__}: {err}"[:2000]
    report.seconds = round(time.monotonic() - begin, 1)
    return report
