"""The final table: one row per metric, upstream and overlay side by side,
with the overlay/upstream ratio."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from benchmarks.harness import markdown_table, ratio

if TYPE_CHECKING:
    from .driver import WorkerRun


def format_value(value: Any) -> str:
    """Short, aligned-friendly text for a table cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    text = str(value)
    return text if len(text) <= 32 else text[:29] + "..."


@dataclass(frozen=True)
class Row:
    """One line of the final table."""

    model: str
    workload: str
    metric: str
    upstream: Any
    overlay: Any

    @property
    def ratio(self) -> float | None:
        return ratio(self.overlay, self.upstream)

    def cells(self) -> list[str]:
        values = [format_value(self.upstream), format_value(self.overlay)]
        shown = "-" if self.ratio is None else f"{self.ratio:.2f}x"
        return [self.model, self.workload, self.metric, *values, shown]


#: The table's columns: a row's fields, then the ratio.
TABLE_HEADER = (*(f.name for f in fields(Row)), "overlay/upstream")


def format_table(rows: Sequence[Row]) -> str:
    return markdown_table(TABLE_HEADER, [row.cells() for row in rows])


#: Table rows per workload: (result path inside the workload, label); the
#: counts are the simulator's (``workloads._counted``).
MANY_SHORT_ROWS: tuple[tuple[str, str], ...] = (
    ("peak_running", "peak running requests"),
    ("needed_over_reserved_at_peak", "needed/reserved at peak"),
    ("max_needed_over_reserved", "needed/reserved max"),
    ("mean_needed_over_reserved", "needed/reserved mean"),
    ("preemptions", "preemptions"),
    ("engine_steps", "engine steps"),
    ("output_tok_per_s", "output tokens/s"),
    ("output_tok_per_cpu_s", "output tokens/CPU s"),
    ("wall_s", "wall s"),
    ("cpu_s", "CPU s"),
)
ADMISSION_ROWS: tuple[tuple[str, str], ...] = (
    ("state_page_padding", "state page padding"),
    ("peak_running", "peak running requests"),
    ("mean_running", "mean running requests"),
    ("preemptions", "preemptions"),
    ("engine_steps", "engine steps"),
    ("byte_limit", "byte-limited concurrency (own pages)"),
    ("byte_limit_mean", "byte limit, mean footprint"),
    ("peak_over_byte_limit", "peak running / byte limit"),
    ("mean_running_waiting", "mean running while requests wait"),
    ("waiting_running_over_byte_limit", "running while requests wait / limit"),
    ("wall_s", "wall s"),
    ("cpu_s", "CPU s"),
)
ONE_LONG_ROWS: tuple[tuple[str, str], ...] = (
    ("longest_prompt", "longest prompt"),
    ("reported_capacity_tokens", "reported capacity"),
    ("reported_over_longest", "reported/longest"),
    ("bound_tokens", "bound (budget-state)/attn"),
    ("longest_over_bound", "longest/bound"),
    ("failed_tries_preempted", "tries preempted"),
    ("failed_tries_stalled", "tries stalled"),
)


def _workload(report: dict[str, Any] | None, name: str) -> dict[str, Any]:
    return (report or {}).get("workloads", {}).get(name, {}) or {}


def _metric(workload: dict[str, Any], key: str) -> Any:
    """A workload's metric; its wall time is kept next to the metrics."""
    return (
        workload.get(key) if key == "wall_s" else workload.get("metrics", {}).get(key)
    )


#: Per-engine rows: (key of the engine description, label).
ENGINE_ROWS: tuple[tuple[str, str], ...] = (
    ("kv_layout", "kv layout"),
    ("kv_bytes_total", "kv bytes in blocks"),
    ("token_capacity", "reported capacity tokens"),
    ("max_model_len", "max_model_len"),
    ("start_s", "start s"),
)


def _engines(report: dict[str, Any] | None) -> dict[str, Any]:
    return ((report or {}).get("engines")) or {}


def _engine_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """Which KV layout each mode ran, and its capacity, per engine."""
    active = [(r or {}).get("overlay_active") for r in (up, ov)]
    rows = [Row(model, "setup", "overlay active", *active)]
    eu_all, eo_all = _engines(up), _engines(ov)
    for name in list(dict.fromkeys([*eu_all, *eo_all])):
        eu, eo = eu_all.get(name, {}), eo_all.get(name, {})
        for key, label in ENGINE_ROWS:
            rows.append(Row(model, f"engine {name}", label, eu.get(key), eo.get(key)))
    return rows


def comparison_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """All table rows of one model."""
    rows = _engine_rows(model, up, ov)
    wu, wo = _workload(up, "many_short"), _workload(ov, "many_short")
    if wu or wo:
        rows += [
            Row(model, "many_short", label, _metric(wu, key), _metric(wo, key))
            for key, label in MANY_SHORT_ROWS
        ]
    wu, wo = _workload(up, "admission"), _workload(ov, "admission")
    if wu or wo:
        rows += [
            Row(model, "admission", label, _metric(wu, key), _metric(wo, key))
            for key, label in ADMISSION_ROWS
        ]
    pu = _workload(up, "one_long").get("parts", {})
    po = _workload(ov, "one_long").get("parts", {})
    for part in list(dict.fromkeys([*pu, *po])):
        wu, wo = pu.get(part, {}), po.get(part, {})
        for key, label in ONE_LONG_ROWS:
            values = _metric(wu, key), _metric(wo, key)
            rows.append(Row(model, f"one_long {part}", label, *values))
        walls = wu.get("wall_s"), wo.get("wall_s")
        rows.append(Row(model, f"one_long {part}", "wall s", *walls))
    return rows


def run_failures(runs: Sequence[WorkerRun]) -> list[str]:
    """Problems that make the benchmark exit non-zero."""
    problems: list[str] = []
    for run in runs:
        where = f"{run.model}/{run.mode}"
        if run.report is None:
            problems.append(f"{where}: no result ({run.error}, see {run.log_path})")
            continue
        problems += [f"{where}: {err}" for err in run.report.get("errors", [])]
    return problems


def admission_lines(
    model: str, up: dict[str, Any] | None, ov: dict[str, Any] | None
) -> list[str]:
    """The admission workload's acceptance checks (pooled mode against the
    byte limit and upstream) and the probe's diagnosis of the pooled drive;
    nothing when the workload did not run in both modes."""
    from .admission import acceptance, diagnosis_lines

    wu, wo = _workload(up, "admission"), _workload(ov, "admission")
    if not (wu and wo):
        return []
    checks = acceptance(wu.get("metrics", {}), wo.get("metrics", {}))
    lines = [f"{model} admission: " + check.line() for check in checks]
    lines += [
        f"{model} admission, pooled drive: " + line
        for line in diagnosis_lines(wo.get("details", {}))
    ]
    return lines
