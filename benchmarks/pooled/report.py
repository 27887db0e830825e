"""The final table: one row per metric, upstream and overlay side by side,
with the overlay/upstream ratio."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .driver import WorkerRun


def ratio(overlay: Any, upstream: Any) -> float | None:
    """overlay / upstream for numbers; None when it has no meaning."""
    if isinstance(overlay, bool) or isinstance(upstream, bool):
        return None
    if not isinstance(overlay, (int, float)) or not isinstance(upstream, (int, float)):
        return None
    if upstream == 0 or math.isnan(upstream) or math.isnan(overlay):
        return None
    return overlay / upstream


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
        ratio = "-" if self.ratio is None else f"{self.ratio:.2f}x"
        return [self.model, self.workload, self.metric, *values, ratio]


#: The table's columns: a row's fields, then the ratio.
TABLE_HEADER = (*(f.name for f in fields(Row)), "overlay/upstream")


def format_table(rows: Sequence[Row]) -> str:
    """Plain-text table; numbers right-aligned, names left-aligned."""
    lines = [list(TABLE_HEADER)] + [row.cells() for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_HEADER))]

    def render(cells: Sequence[str]) -> str:
        left = [c.ljust(w) for c, w in zip(cells[:3], widths[:3], strict=True)]
        right = [c.rjust(w) for c, w in zip(cells[3:], widths[3:], strict=True)]
        return "  ".join(left + right).rstrip()

    out = [render(lines[0]), "  ".join("-" * w for w in widths)]
    out += [render(line) for line in lines[1:]]
    return "\n".join(out)


#: Table rows per workload: (result path inside the workload, label); the
#: counts are the simulator's (``workloads._counted``).
COUNTED_ROWS: tuple[tuple[str, str], ...] = (
    ("preemptions", "preemptions"),
    ("engine_steps", "engine steps"),
    ("output_tok_per_s", "output tokens/s"),
    ("output_tok_per_cpu_s", "output tokens/CPU s"),
    ("wall_s", "wall s"),
    ("cpu_s", "CPU s"),
)
MANY_SHORT_ROWS: tuple[tuple[str, str], ...] = (
    ("peak_running", "peak running requests"),
    ("needed_over_reserved_at_peak", "needed/reserved at peak"),
    ("max_needed_over_reserved", "needed/reserved max"),
    ("mean_needed_over_reserved", "needed/reserved mean"),
    *COUNTED_ROWS,
)
MULTI_TURN_ROWS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "prefix hit rate (tokens)"),
    ("hit_rate_first_turn", "hit rate, first turn"),
    ("hit_tokens_first_turn", "hit tokens, first turn"),
    ("hit_rate_last_turn", "hit rate, last turn"),
    ("coupled_evictions", "coupled evictions"),
    ("hit_tokens", "hit tokens"),
    ("prompt_tokens", "prompt tokens"),
    *COUNTED_ROWS,
    ("state_copies", "state copies"),
    ("checkpoints_cached", "checkpoints cached"),
    ("prefill_tokens", "prefill tokens computed"),
    ("decode_tokens", "decode tokens"),
    ("prefill_checkpoint_cuts", "prefill chunks cut at a checkpoint"),
)
ONE_LONG_ROWS: tuple[tuple[str, str], ...] = (
    ("longest_prompt", "longest prompt"),
    ("reported_capacity_tokens", "reported capacity"),
    ("reported_over_longest", "reported/longest"),
    ("bound_tokens", "bound (budget-state)/attn"),
    ("longest_over_bound", "longest/bound"),
    ("failed_tries_preempted", "tries preempted"),
    ("failed_tries_stalled", "tries stalled"),
    ("max_model_len", "max_model_len used"),
    ("engine_start_error", "engine start error"),
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


def _engine_value(engine: dict[str, Any], key: str) -> Any:
    failed = key == "kv_layout" and engine.get("start_error")
    return "start failed" if failed else engine.get(key)


def _engine_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """Which KV layout each mode ran, and its capacity, per engine."""
    active = [(r or {}).get("overlay_active") for r in (up, ov)]
    rows = [Row(model, "setup", "overlay active", *active)]
    eu_all, eo_all = _engines(up), _engines(ov)
    for name in list(dict.fromkeys([*eu_all, *eo_all])):
        eu, eo = eu_all.get(name, {}), eo_all.get(name, {})
        for key, label in ENGINE_ROWS:
            values = _engine_value(eu, key), _engine_value(eo, key)
            rows.append(Row(model, f"engine {name}", label, *values))
    return rows


def start_error_notes(runs: Sequence[WorkerRun]) -> list[str]:
    """Full text of engine start errors (the table truncates them)."""
    notes = []
    for run in runs:
        for name, engine in _engines(run.report).items():
            if engine.get("start_error"):
                error = engine["start_error"]
                notes.append(f"{run.model}/{run.mode} {name} start_error: {error}")
    return notes


def comparison_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """All table rows of one model."""
    rows = _engine_rows(model, up, ov)
    for name, spec in (
        ("many_short", MANY_SHORT_ROWS),
        ("multi_turn", MULTI_TURN_ROWS),
    ):
        wu, wo = _workload(up, name), _workload(ov, name)
        if not (wu or wo):
            continue
        rows += [
            Row(model, name, label, _metric(wu, key), _metric(wo, key))
            for key, label in spec
        ]
    pu = _workload(up, "one_long").get("parts", {})
    po = _workload(ov, "one_long").get("parts", {})
    for part in list(dict.fromkeys([*pu, *po])):
        wu, wo = pu.get(part, {}), po.get(part, {})
        for key, label in ONE_LONG_ROWS:
            a, b = _metric(wu, key), _metric(wo, key)
            if key == "engine_start_error" and a is None and b is None:
                continue
            rows.append(Row(model, f"one_long {part}", label, a, b))
        walls = wu.get("wall_s"), wo.get("wall_s")
        rows.append(Row(model, f"one_long {part}", "wall s", *walls))
    return rows


def run_failures(runs: Sequence[WorkerRun]) -> list[str]:
    """Problems that make the benchmark exit non-zero."""
    problems: list[str] = []
    for run in runs:
        where = f"{run.model}/{run.mode}"
        if run.report is None:
            problems.append(
                f"{where}: no result line (exit {run.returncode}, see {run.log_path})"
            )
            continue
        if run.returncode != 0:
            problems.append(f"{where}: worker exit code {run.returncode}")
        problems += [f"{where}: {err}" for err in run.report.get("errors", [])]
    return problems
