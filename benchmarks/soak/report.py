"""The one-screen summary of a soak mode."""

from __future__ import annotations

from .client import RESULTS
from .config import MIB
from .runner import ModeReport, rss_growth_by_role

SHORT = {
    "ok": "ok",
    "expected_4xx": "400*",
    "disconnected": "disc",
    "unexpected_4xx": "4xx!",
    "5xx": "5xx",
    "invalid": "inv",
    "stream_error": "serr",
    "hang": "hang",
    "transport": "conn",
}


def summary(report: ModeReport) -> str:
    cfg = report.config
    lines = [
        f"== soak {report.mode}: {report.model}, "
        f"kv_cache_dtype {report.kv_cache_dtype}, "
        f"KV {cfg['kv_cache_mib']} MiB, max_model_len {cfg['max_model_len']}, "
        f"max_num_seqs {cfg['max_num_seqs']}, seed {cfg['seed']} ==",
        f"server start {report.startup_seconds:.0f}s; total {report.seconds:.0f}s; "
        f"log {report.log_path}",
    ]
    lines += [f"  {line}" for line in report.plan_lines[:2]]
    if report.error:
        lines.append(f"ERROR: {report.error}")
    head = f"{'phase':<10}{'sent':>6}{'thr':>5}{'s':>6}" + "".join(
        f"{SHORT[r]:>6}" for r in RESULTS
    )
    head += f"{'p50 s':>7}{'max s':>7}{'run':>5}{'wait':>5}{'RSS MiB':>9}  checks"
    lines.append(head)
    for phase in report.phases:
        row = f"{phase.name:<10}{phase.sent:>6}{phase.threads:>5}{phase.seconds:>6.0f}"
        row += "".join(f"{phase.counts.get(r, 0):>6}" for r in RESULTS)
        row += f"{phase.latency.get('p50', 0):>7.2f}{phase.latency.get('max', 0):>7.1f}"
        peaks = phase.peaks
        row += f"{peaks.get('running', 0):>5.0f}{peaks.get('waiting', 0):>5.0f}"
        row += f"{phase.rss_bytes / MIB:>9.0f}  "
        if phase.skipped and not phase.sent and phase.ok:
            row += "skipped (time limit)"
        else:
            bad = [c.name for c in phase.checks if not c.ok]
            row += "FAILED: " + ", ".join(bad) if bad else "ok"
        lines.append(row)
    total = report.totals()
    sent = sum(total.values())
    lines.append(
        f"{'total':<10}{sent:>6}{'':>5}{'':>6}"
        + "".join(f"{total.get(r, 0):>6}" for r in RESULTS)
    )
    preempt = max((p.peaks.get("preemptions", 0) for p in report.phases), default=0)
    lines.append(
        f"(400* = expected 400 for prompts beyond max_model_len; disc = client "
        f"disconnected on purpose; run/wait = peak running/waiting requests; "
        f"preemptions {preempt:.0f})"
    )
    for phase in report.phases:
        for failure in phase.failures:
            lines.append(f"  ! {phase.name}: {failure}")
    for where, check in report.all_checks:
        if where == "end" or not check.ok:
            mark = "PASS" if check.ok else "FAIL"
            mark = mark if check.judged else "INFO"
            lines.append(f"{mark} [{where}] {check.name}: {check.detail}")
    rss = ", ".join(f"{k} {v / MIB:.0f}" for k, v in report.rss.items())
    lines.append(f"RSS MiB (all server processes): {rss}")
    anon = ", ".join(f"{k} {v / MIB:.0f}" for k, v in report.rss_anon.items())
    lines.append(f"  of which RssAnon: {anon}")
    growth = rss_growth_by_role(report, report.rss_middle_phase, "end")
    if growth:
        parts = ", ".join(f"{k} {v / MIB:+.1f}" for k, v in growth.items())
        lines.append(f"RSS growth {report.rss_middle_phase} -> end, MiB: {parts}")
    lines.append(f"RESULT {report.mode}: {'PASS' if report.ok else 'FAIL'}")
    return "\n".join(lines)
