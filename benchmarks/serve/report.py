"""Ratio rows, the printed tables (Markdown, as
benchmarks/results/serve-20261126.md shows them) and the JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from benchmarks.harness import markdown_table, ratio, server_args

from .config import BenchConfig, rate_key
from .run import RateRun, ServerResult

#: Table columns: (flat key, header, format).
COLUMNS = (
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "tok/s", "{:.1f}"),
    ("p50_ttft_ms", "TTFT50", "{:.0f}"),
    ("p90_ttft_ms", "TTFT90", "{:.0f}"),
    ("p99_ttft_ms", "TTFT99", "{:.0f}"),
    ("p50_tpot_ms", "TPOT50", "{:.1f}"),
    ("p90_tpot_ms", "TPOT90", "{:.1f}"),
    ("p99_tpot_ms", "TPOT99", "{:.1f}"),
    ("prefix_hit_rate", "hit", "{:.3f}"),
    ("peak_running", "run", "{:.0f}"),
    ("preemptions", "preem", "{:.0f}"),
)
BASELINE_DTYPE = "auto"


@dataclass
class RatioRow:
    """``numerator / denominator`` of every column at one rate:
    ``pooled/upstream`` (same dtype, named by ``group``) or ``<dtype>/auto``
    (same mode, named by ``group``)."""

    model: str
    comparison: str
    group: str
    rate: str
    values: dict[str, float | None]


def _clean_runs(result: ServerResult) -> dict[str, RateRun]:
    """Runs without a failed request: only those are compared."""
    return {r.rate: r for r in result.runs if not r.errors and not r.values["failed"]}


def ratio_rows(
    results: Sequence[ServerResult], rates: Sequence[float]
) -> list[RatioRow]:
    """Pooled over upstream per model, dtype and rate; then each quantized
    dtype over ``auto`` per model, mode and rate, wherever both ran cleanly."""
    runs = {(r.model, r.mode, r.dtype): _clean_runs(r) for r in results}
    models, modes, dtypes = (
        list(dict.fromkeys(getattr(r, key) for r in results))
        for key in ("model", "mode", "dtype")
    )
    pairs = [
        (m, "pooled/upstream", d, (m, "pooled", d), (m, "upstream", d))
        for m in models
        for d in dtypes
    ] + [
        (m, f"{d}/{BASELINE_DTYPE}", mode, (m, mode, d), (m, mode, BASELINE_DTYPE))
        for m in models
        for mode in modes
        for d in dtypes
        if d != BASELINE_DTYPE
    ]
    rows = []
    for model, comparison, group, num_key, den_key in pairs:
        num, den = runs.get(num_key, {}), runs.get(den_key, {})
        for rate in map(rate_key, rates):
            if rate in num and rate in den:
                values = {
                    key: ratio(num[rate].values.get(key), den[rate].values.get(key))
                    for key, _, _ in COLUMNS
                }
                rows.append(RatioRow(model, comparison, group, rate, values))
    return rows


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def results_table(results: Sequence[ServerResult]) -> str:
    """One row per server and rate; a server that did not run or failed
    says why."""
    rows = []
    for r in results:
        lead = [r.model, r.mode, r.dtype]
        for run in r.runs:
            ok, failed = (int(run.values[k] or 0) for k in ("completed", "failed"))
            done = f"{ok}/{ok + failed}"
            cells = [_cell(run.values.get(key), fmt) for key, _, fmt in COLUMNS]
            rows.append([*lead, run.rate, done, *cells])
        if r.status != "ok":
            rows.append([*lead, r.status, r.reason, *[""] * len(COLUMNS)])
    head = ("model", "mode", "dtype", "rate", "done", *(h for _, h, _ in COLUMNS))
    return markdown_table(head, rows)


def ratio_table(rows: Sequence[RatioRow]) -> str:
    """Above 1 is better for req/s, tok/s, hit rate and running requests;
    below 1 for TTFT, TPOT and preemptions."""
    body = [
        [row.model, row.comparison, row.group, row.rate]
        + [_cell(row.values.get(key), "{:.2f}x") for key, _, _ in COLUMNS]
        for row in rows
    ]
    head = ("model", "comparison", "group", "rate", *(h for _, h, _ in COLUMNS))
    return markdown_table(head, body)


def document(
    cfg: BenchConfig,
    results: Sequence[ServerResult],
    rows: Sequence[RatioRow],
    ok: bool,
) -> dict:
    """Everything of the invocation, as ``--json`` writes it."""
    return {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "server_args": {d: server_args(cfg, d) for d in cfg.dtypes},
        "bench_args": {
            rate_key(r): cfg.bench_args("URL", "MODEL", r) for r in cfg.rates
        },
        "servers": [asdict(r) for r in results],
        "ratios": [asdict(row) for row in rows],
        "ok": ok,
    }
