"""What the soak checks on the server between phases and at the end."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .client import Target, parse_metrics, pool_label, send, summarize_metrics
from .workload import RequestSpec

MIB = 2**20


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    #: False: measured and reported, but the run was too short to judge it.
    judged: bool = True


# -- health ----------------------------------------------------------------
def health(target: Target) -> Check:
    try:
        status, _ = target.get("/health", timeout=30.0)
    except OSError as err:
        return Check("health", False, f"/health: {err!r}")
    return Check("health", status == 200, f"/health {status}")


# -- idle KV pools ---------------------------------------------------------
@dataclass
class IdleKV:
    """The KV gauges once the server had nothing to do."""

    ok: bool
    #: ``token``/``state`` used bytes (pooled mode), ``kv_cache_usage_perc``,
    #: running and waiting requests.
    values: dict[str, float] = field(default_factory=dict)
    waited: float = 0.0
    detail: str = ""


def idle_kv(target: Target, pooled: bool, timeout: float) -> IdleKV:
    """Poll ``/metrics`` until no request runs or waits and the KV gauges
    read 0: both pools' ``vllm_hybrid:kv_pool_used_bytes`` in pooled mode,
    ``vllm:kv_cache_usage_perc`` in both modes. A value that stays above 0
    for ``timeout`` seconds is a leaked block."""
    start = time.monotonic()
    values: dict[str, float] = {}
    detail = ""
    while True:
        try:
            status, raw = target.get("/metrics", timeout=10.0)
        except OSError as err:
            status, raw, detail = 0, b"", repr(err)
        if status == 200:
            values = idle_values(raw.decode(), pooled)
            detail = ""
            if pooled and (
                "token_used_bytes" not in values or "state_used_bytes" not in values
            ):
                detail = "no vllm_hybrid:kv_pool_used_bytes samples for both pools"
            elif all(value == 0 for value in values.values()):
                return IdleKV(True, values, time.monotonic() - start)
        waited = time.monotonic() - start
        if waited > timeout:
            busy = {k: v for k, v in values.items() if v}
            return IdleKV(
                False, values, waited, detail or f"not idle after {waited:.0f}s: {busy}"
            )
        time.sleep(0.5)


def idle_values(text: str, pooled: bool) -> dict[str, float]:
    summary = summarize_metrics(text)
    values = {
        "running": summary["running"],
        "waiting": summary["waiting"],
        "kv_cache_usage_perc": summary["kv_cache_usage_perc"],
    }
    if pooled:
        for labels, value in (
            parse_metrics(text).get("vllm_hybrid:kv_pool_used_bytes", {}).items()
        ):
            values[f"{pool_label(labels)}_used_bytes"] = value
    return values


# -- RSS -------------------------------------------------------------------
def _status_fields(pid: int) -> dict[str, str]:
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/*/status PPid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _status_fields(int(entry))
        if "PPid" in fields:
            children.setdefault(int(fields["PPid"]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def process_rss(pid: int, kind: str = "VmRSS") -> dict[str, int]:
    """``{"name pid": bytes}`` of the server process and its children (API
    server, engine core, workers, multiprocessing helpers): resident memory
    (``VmRSS``), or one part of it (``RssAnon``: heap and other private
    memory; ``RssFile``: mapped files such as the libraries' code)."""
    out = {}
    for proc in descendants(pid):
        fields = _status_fields(proc)
        rss = fields.get(kind)
        if rss is None:
            continue
        kib = int(rss.split()[0])
        out[f"{fields.get('Name', '?')} {proc}"] = kib * 1024
    return out


# -- greedy probes ---------------------------------------------------------
def run_probes(target: Target, specs: list[RequestSpec]) -> list[list[int] | str]:
    """Send the probes one at a time (each alone on the server: its tokens do
    not depend on a batch); the token ids of each, or the failure."""
    out: list[list[int] | str] = []
    for spec in specs:
        outcome = send(target, spec)
        if outcome.result == "ok" and outcome.token_ids is not None:
            out.append(list(outcome.token_ids))
        else:
            out.append(f"{outcome.result} {outcome.status}: {outcome.detail}")
    return out


def same_tokens(start: list, end: list) -> Check:
    pairs = list(zip(start, end, strict=False))
    equal = sum(1 for a, b in pairs if isinstance(a, list) and a == b)
    total = len(start)
    if equal == total and len(end) == total:
        return Check("greedy same tokens", True, f"{equal}/{total} probes")
    diffs = []
    for i, (a, b) in enumerate(pairs):
        if a != b:
            if isinstance(a, list) and isinstance(b, list):
                at = next(
                    (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
                diffs.append(f"probe {i} differs at token {at}")
            else:
                diffs.append(f"probe {i}: {a if isinstance(a, str) else b}")
    return Check("greedy same tokens", False, f"{equal}/{total}; " + "; ".join(diffs))


# -- log -------------------------------------------------------------------
def log_problems(log_text: str, limit: int = 5) -> list[str]:
    """Lines of the server log (up to shutdown) that report a failure."""
    from vllm_hybrid.tools.server import PROBLEM_MARKERS, SHUTDOWN_MARKER

    found = []
    for line in log_text.splitlines():
        if SHUTDOWN_MARKER in line:
            break
        if any(marker in line for marker in PROBLEM_MARKERS):
            found.append(line.strip()[:240])
    return found[:limit] + (
        [f"... {len(found) - limit} more"] if len(found) > limit else []
    )
