"""Ratio rows, the printed tables and the JSON document."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import BenchConfig, rate_key
from .metrics import RunSummary, ratio_values
from .runner import ServerResult

#: Columns of both tables: (flat metric name, header, format).
COLUMNS = (
    ("req_per_s", "req/s", "{:.2f}"),
    ("output_tok_per_s", "tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT50", "{:.0f}"),
    ("ttft_p90_ms", "TTFT90", "{:.0f}"),
    ("ttft_p99_ms", "TTFT99", "{:.0f}"),
    ("tpot_p50_ms", "TPOT50", "{:.1f}"),
    ("tpot_p90_ms", "TPOT90", "{:.1f}"),
    ("tpot_p99_ms", "TPOT99", "{:.1f}"),
    ("prefix_hit_rate", "hit", "{:.3f}"),
    ("peak_running", "run", "{:.0f}"),
    ("preemptions", "preem", "{:.0f}"),
)
BASELINE_DTYPE = "auto"


@dataclass
class RatioRow:
    """``numerator / denominator`` of every metric at one rate.

    ``comparison`` is ``pooled/upstream`` (same dtype, ``group`` names it)
    or ``<dtype>/auto`` (same mode, ``group`` names it).
    """

    model: str
    comparison: str
    group: str
    rate: str
    values: dict[str, float | None]


def _clean_runs(result: ServerResult) -> dict[str, RunSummary]:
    """Runs without a failed request: only those are compared."""
    return {run.rate: run for run in result.runs if run.errors == 0}


def ratio_rows(
    results: Sequence[ServerResult], rates: Sequence[float]
) -> list[RatioRow]:
    """Pooled over upstream per model, dtype and rate; then each quantized
    dtype over ``auto`` per model, mode and rate (what TurboQuant costs or
    gains end to end), wherever both sides ran cleanly."""
    runs = {(r.model, r.mode, r.dtype): _clean_runs(r) for r in results}
    models = list(dict.fromkeys(r.model for r in results))
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    rows: list[RatioRow] = []
    pairs = [
        (
            model,
            "pooled/upstream",
            dtype,
            (model, "pooled", dtype),
            (model, "upstream", dtype),
        )
        for model in models
        for dtype in dtypes
    ] + [
        (
            model,
            f"{dtype}/{BASELINE_DTYPE}",
            mode,
            (model, mode, dtype),
            (model, mode, BASELINE_DTYPE),
        )
        for model in models
        for mode in modes
        for dtype in dtypes
        if dtype != BASELINE_DTYPE
    ]
    for model, comparison, group, num_key, den_key in pairs:
        num, den = runs.get(num_key, {}), runs.get(den_key, {})
        for rate in map(rate_key, rates):
            if rate in num and rate in den:
                values = ratio_values(num[rate].flat(), den[rate].flat())
                rows.append(RatioRow(model, comparison, group, rate, values))
    return rows


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _header(first: Sequence[tuple[str, int]]) -> str:
    return "".join(f"{name:<{width}}" for name, width in first) + "".join(
        f"{head:>8}" for _, head, _ in COLUMNS
    )


def results_table(results: Sequence[ServerResult]) -> str:
    """One row per server and rate; TTFT/TPOT in ms; ``hit`` the prefix
    cache hit rate; ``run`` peak running requests; ``preem`` preemptions;
    ``lag ms`` the latest a request left the client after its planned time."""
    first = (("model", 12), ("mode", 10), ("dtype", 17), ("rate", 7), ("done", 7))
    lines = [_header(first) + f"{'lag ms':>8}"]
    for result in results:
        lead = f"{result.model:<12}{result.mode:<10}{result.dtype:<17}"
        if result.status == "not_runnable" and not result.runs:
            lines.append(f"{lead}{result.reason}")
            continue
        for run in result.runs:
            done = f"{run.completed}/{run.requests}"
            row = f"{lead}{run.rate:<7}{done:<7}"
            flat = run.flat()
            row += "".join(f"{_cell(flat[key], fmt):>8}" for key, _, fmt in COLUMNS)
            lines.append(row + f"{run.max_send_lag_ms:>8.0f}")
        if result.status != "ok":
            lines.append(f"{lead}{result.status.upper()}: {result.reason}")
    return "\n".join(lines)


def ratio_table(rows: Sequence[RatioRow]) -> str:
    """Ratios: above 1 is better for req/s, tok/s, hit rate and running
    requests; below 1 is better for TTFT and TPOT."""
    first = (("model", 12), ("comparison", 26), ("group", 17), ("rate", 7))
    lines = [_header(first)]
    for row in rows:
        lead = f"{row.model:<12}{row.comparison:<26}{row.group:<17}{row.rate:<7}"
        cells = "".join(
            f"{_cell(row.values.get(key), '{:.2f}x'):>8}" for key, _, _ in COLUMNS
        )
        lines.append(lead + cells)
    return "\n".join(lines)


def _plain(obj):
    """JSON-safe copy: paths as strings, infinite rates as ``"inf"``."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    return obj


def document(
    cfg: BenchConfig,
    results: Sequence[ServerResult],
    rows: Sequence[RatioRow],
    probe: dict,
    log_dir: Path,
    ok: bool,
) -> dict:
    """Everything of the invocation, as written by ``--json``."""
    return _plain(
        {
            "config": asdict(cfg),
            "server_args": {d: cfg.server_args(d) for d in cfg.dtypes},
            "upstream_dtype_probe": probe,
            "servers": [r.to_json() for r in results],
            "ratios": [asdict(row) for row in rows],
            "log_dir": log_dir,
            "ok": ok,
        }
    )
