"""The comparison as a table (ratios to upstream-best), JSON and a plot.

Counted figures are what the engines did; modeled ones come from the cost
model of :mod:`.clock` and are labelled "modeled" wherever they appear.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from vllm_hybrid.tools.simulate.metrics import SMALL_SAMPLE

#: The reference the summary rows' ratios are taken to (falls back to
#: upstream).
REFERENCE = ("upstream-best", "upstream")


class Row(NamedTuple):
    """One row of the table: a figure of every engine's best run."""

    label: str
    #: where the figure lives in :func:`flat_figures`
    section: str
    key: str
    fmt: str
    #: whether the cell shows its ratio to the reference engine
    ratio: bool
    #: LOWER or HIGHER where one way is better; None for a plain count
    better: str | None = None


LOWER, HIGHER = "lower", "higher"
#: The mark of each direction in the table's first column.
MARKS = {LOWER: "↓", HIGHER: "↑"}

#: Every table row, in order.
ROWS: tuple[Row, ...] = (
    Row("peak running (counted)", "counted", "peak_running", "{:,}", True),
    Row("mean running per step (counted)", "counted", "mean_running", "{:,.1f}", True),
    Row("preemptions (counted)", "counted", "preemptions", "{:,}", False, LOWER),
    Row(
        "prefix hit rate, tokens (counted)",
        "counted",
        "hit_rate",
        "{:.3f}",
        True,
        HIGHER,
    ),
    Row(
        "prefill tokens computed (counted)",
        "counted",
        "prefill_tokens",
        "{:,}",
        True,
        LOWER,
    ),
    Row("floor: tokens no cache could serve", "counted", "floor_tokens", "{:,}", False),
    Row(
        "prefill tokens above the floor",
        "counted",
        "above_floor",
        "{:,}",
        True,
        LOWER,
    ),
    Row("state copies (counted)", "counted", "copies_moved", "{:,}", True, LOWER),
    Row(
        "edges crossed in place (counted)",
        "counted",
        "state_self_copies",
        "{:,}",
        False,
    ),
    Row(
        "chunks read out of place (counted)",
        "counted",
        "state_reads_elsewhere",
        "{:,}",
        False,
    ),
    Row("copy-on-write block copies (counted)", "counted", "cow_copies", "{:,}", False),
    Row("token blocks moved (counted)", "counted", "token_moves", "{:,}", False),
    Row("bytes copied, GB (counted)", "counted", "copy_gb", "{:,.1f}", True, LOWER),
    Row(
        "checkpoints cached (counted)",
        "counted",
        "checkpoints_cached",
        "{:,.0f}",
        True,
    ),
    Row("TTFT p50, s (modeled)", "modeled", "ttft_p50", "{:.2f}", True, LOWER),
    Row("TTFT p99, s (modeled)", "modeled", "ttft_p99", "{:.2f}", True, LOWER),
    Row("TPOT p50, ms (modeled)", "modeled", "tpot_p50_ms", "{:.1f}", True, LOWER),
    Row("TPOT p99, ms (modeled)", "modeled", "tpot_p99_ms", "{:.1f}", True, LOWER),
    Row(
        "output tokens/s (modeled)",
        "modeled",
        "output_tok_per_s",
        "{:,.0f}",
        True,
        HIGHER,
    ),
    Row(
        "scheduler CPU per step, ms, this host",
        "host",
        "cpu_mean_ms",
        "{:.2f}",
        True,
        LOWER,
    ),
    Row(
        "scheduler CPU per step p99, ms, this host",
        "host",
        "cpu_p99_ms",
        "{:.2f}",
        True,
        LOWER,
    ),
)

#: Percentile cells and the requests each rests on (``n`` of the run's
#: summary): below :data:`~.metrics.SMALL_SAMPLE` they are marked.
SAMPLED = {
    "ttft_p50": "ttft_n",
    "ttft_p99": "ttft_n",
    "tpot_p50_ms": "tpot_n",
    "tpot_p99_ms": "tpot_n",
}

#: Rows shown only when some run has the figure (traces with follow-ups;
#: token moves and the scheduler's CPU, which older runs did not record).
OPTIONAL_KEYS = frozenset(
    {"floor_tokens", "above_floor", "token_moves", "cpu_mean_ms", "cpu_p99_ms"}
)


def flat_figures(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The table's figures of one run, derived units included."""
    counted = dict(summary.get("counted") or {})
    modeled = dict(summary.get("modeled") or {})
    counted["copy_gb"] = (counted.get("copy_bytes") or 0) / 1e9
    # a self copy (an edge crossed in place) moves nothing, and a chunk that
    # reads out of place needs none: the runner skips both (StepRecord)
    counted["copies_moved"] = (
        (counted.get("state_copies") or 0)
        - (counted.get("state_self_copies") or 0)
        - (counted.get("state_reads_elsewhere") or 0)
    )
    floor = counted.get("floor_tokens")
    if floor is not None:
        counted["above_floor"] = counted["prefill_tokens"] - floor
    ttft, tpot = modeled.get("ttft_s") or {}, modeled.get("tpot_s") or {}
    modeled["ttft_p50"], modeled["ttft_p99"] = ttft.get("p50"), ttft.get("p99")
    modeled["tpot_p50_ms"] = tpot["p50"] * 1e3 if "p50" in tpot else None
    modeled["tpot_p99_ms"] = tpot["p99"] * 1e3 if "p99" in tpot else None
    modeled["ttft_n"], modeled["tpot_n"] = ttft.get("n"), tpot.get("n")
    per_step = (summary.get("host") or {}).get("scheduler_cpu_ms_per_step") or {}
    host = {"cpu_mean_ms": per_step.get("mean"), "cpu_p99_ms": per_step.get("p99")}
    return {"counted": counted, "modeled": modeled, "host": host}


def best_runs(engines: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Engine name -> the summary of its best run."""
    return {name: e["runs"][e["best"]] for name, e in engines.items()}


def best_key(summary: Mapping[str, Any]) -> tuple:
    """Sort key of a sweep's runs: fewest prefill tokens, then most hits;
    failed runs last."""
    counted = summary.get("counted")
    if not counted or counted.get("outcome") != "finished":
        return (1, 0, 0)
    return (0, counted["prefill_tokens"], -counted["hit_tokens"])


def better_upstream(engines: Mapping[str, Any]) -> str | None:
    """Of the upstream engines that ran, the one that computed the fewest
    prefill tokens (then the most hits: :func:`best_key`)."""
    runs = best_runs(engines)
    upstream = [n for n in runs if n.startswith("upstream") and "error" not in runs[n]]
    return min(upstream, key=lambda n: best_key(runs[n]), default=None)


def _cell(value: Any, fmt: str, reference: Any, ratio: bool) -> str:
    if value is None:
        return "-"
    text = fmt.format(value)
    if ratio and reference and engine_ratio_defined(reference):
        text += f" ({value / reference:.2f}x)"
    return text


def engine_label(engines: Mapping[str, Any], name: str) -> str:
    """An engine's name, with its best run's name for a swept engine."""
    return f"{name} ({engines[name]['best']})" if name.endswith("best") else name


def engine_ratio_defined(reference: Any) -> bool:
    return isinstance(reference, (int, float)) and reference != 0


def _label(row: Row) -> str:
    """A row's label with its better direction's mark."""
    return f"{row.label} {MARKS[row.better]}" if row.better else row.label


def _small_sample(figures: Mapping[str, Any], row: Row) -> int | None:
    """The request count a percentile cell rests on, when it is small."""
    count_key = SAMPLED.get(row.key)
    count = figures[row.section].get(count_key) if count_key else None
    return count if count is not None and count < SMALL_SAMPLE else None


def render_table(engines: Mapping[str, Any]) -> str:
    """A Markdown table: one column per engine (its best run), ratios to
    the reference engine in parentheses, the better direction of each row
    marked, percentiles over fewer than 100 requests starred. The
    reference is the better upstream engine (:func:`better_upstream`)."""
    runs = best_runs(engines)
    names = list(runs)
    figures = {n: flat_figures(runs[n]) for n in names}
    reference = better_upstream(engines)
    header = [
        "",
        *(engine_label(engines, n) for n in names),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    small: dict[str, int] = {}
    for row in ROWS:
        if row.key in OPTIONAL_KEYS and all(
            figures[n][row.section].get(row.key) is None for n in names
        ):
            continue
        ref = figures[reference][row.section].get(row.key) if reference else None
        cells = []
        for n in names:
            if "error" in runs[n]:
                cells.append("failed")
                continue
            value = figures[n][row.section].get(row.key)
            compare = row.ratio and n != reference
            cell = _cell(value, row.fmt, ref, compare)
            count = _small_sample(figures[n], row)
            if count is not None and value is not None:
                cell += " *"
                small[n] = count
            cells.append(cell)
        lines.append(f"| {_label(row)} | " + " | ".join(cells) + " |")
    errors = [f"{n}: {runs[n]['error']}" for n in names if "error" in runs[n]]
    lines.append("")
    lines.append(
        "↓ lower is better, ↑ higher is better"
        + (f"; ratios to {reference}." if reference else ".")
    )
    if small:
        counts = ", ".join(f"{n} {c:,}" for n, c in small.items())
        lines.append(
            f"* a percentile of fewer than {SMALL_SAMPLE} requests ({counts}): "
            "a p99 of them is close to their largest value."
        )
    return "\n".join(lines + [f"error: {e}" for e in errors])


#: Columns of :func:`render_summary` (one row per engine).
SUMMARY_HEADER = (
    "| case | engine | hit rate | prefill tokens | peak running | preemptions "
    "| state copies, GB | TTFT p50 / p99, s (modeled) "
    "| scheduler CPU per step, ms (this host) |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _reference(runs: Mapping[str, Any]) -> tuple[str | None, dict]:
    """The engine ratios are taken to, and its counted figures with the
    scheduler's CPU per step (``cpu_mean_ms``) among them."""
    reference = next((r for r in REFERENCE if r in runs), None)
    if reference is None:
        return None, {}
    figures = flat_figures(runs[reference])
    return reference, {**figures["counted"], **figures["host"]}


def _count_cell(
    counted: Mapping[str, Any], ref: Mapping[str, Any], key: str, compare: bool
) -> str:
    """A counted figure, with its ratio to the reference engine's when
    ``compare`` and that ratio is defined; "-" when not counted."""
    value = counted.get(key)
    if value is None:
        return "-"
    text = f"{value:,}"
    if compare and engine_ratio_defined(ref.get(key)):
        text += f" ({value / ref[key]:.3f}x)"
    return text


def _cpu_cell(host: Mapping[str, Any], ref: Mapping[str, Any], compare: bool) -> str:
    """The scheduler's mean CPU per step in ms, with its ratio to the
    reference engine's when ``compare``; "-" where a run did not record it."""
    value = host.get("cpu_mean_ms")
    if value is None:
        return "-"
    text = f"{value:.2f}"
    if compare and ref.get("cpu_mean_ms"):
        text += f" ({value / ref['cpu_mean_ms']:.2f}x)"
    return text


def _ttft_cell(modeled: Mapping[str, Any]) -> str:
    """Modeled TTFT p50 / p99 in seconds, "-" when not modeled."""
    if modeled.get("ttft_p50") is None:
        return "-"
    return f"{modeled['ttft_p50']:.2f} / {modeled['ttft_p99']:.2f}"


def render_summary(engines: Mapping[str, Any], case: str) -> str:
    """Rows of a compact table, one per engine (its best run), that several
    comparisons share (:data:`SUMMARY_HEADER`): counted figures with the
    prefill tokens' ratio to the reference engine, and modeled TTFT."""
    runs = best_runs(engines)
    reference, ref = _reference(runs)
    lines = []
    for name, summary in runs.items():
        label = engine_label(engines, name)
        if "error" in summary:
            lines.append(f"| {case} | {label} | failed | | | | | | |")
            continue
        figures = flat_figures(summary)
        c, m = figures["counted"], figures["modeled"]
        compare = name != reference
        prefill = _count_cell(c, ref, "prefill_tokens", compare)
        lines.append(
            f"| {case} | {label} | {c['hit_rate'] or 0:.3f} | {prefill} "
            f"| {c['peak_running']:,} | {c['preemptions']:,} "
            f"| {c['copy_gb']:,.0f} | {_ttft_cell(m)} "
            f"| {_cpu_cell(figures['host'], ref, compare)} |"
        )
    return "\n".join(lines)


#: Columns of :func:`render_floor_summary` (one row per engine).
FLOOR_HEADER = (
    "| case | engine | hit rate | prefill tokens | floor | above the floor "
    "| peak running | preemptions | TTFT p50 / p99, s (modeled) "
    "| scheduler CPU per step, ms (this host) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def render_floor_summary(engines: Mapping[str, Any], case: str) -> str:
    """Rows of a compact table for traces with follow-ups
    (:data:`FLOOR_HEADER`): prefill tokens and the part of them above the
    floor, each with its ratio to the reference engine."""
    runs = best_runs(engines)
    reference, ref = _reference(runs)
    lines = []
    for name, summary in runs.items():
        label = engine_label(engines, name)
        if "error" in summary:
            lines.append(f"| {case} | {label} | failed | | | | | | | |")
            continue
        figures = flat_figures(summary)
        c, m = figures["counted"], figures["modeled"]
        compare = name != reference
        prefill = _count_cell(c, ref, "prefill_tokens", compare)
        above = _count_cell(c, ref, "above_floor", compare)
        floor = _count_cell(c, ref, "floor_tokens", False)
        lines.append(
            f"| {case} | {label} | {c['hit_rate'] or 0:.3f} | {prefill} | {floor} "
            f"| {above} | {c['peak_running']:,} | {c['preemptions']:,} "
            f"| {_ttft_cell(m)} | {_cpu_cell(figures['host'], ref, compare)} |"
        )
    return "\n".join(lines)


def render_sweeps(engines: Mapping[str, Any]) -> str:
    """One line per run of every swept engine: prefill tokens, hit rate."""
    lines = []
    for engine in engines.values():
        if len(engine["runs"]) < 2:
            continue
        for run_name, summary in engine["runs"].items():
            counted = summary.get("counted")
            mark = " (best)" if run_name == engine["best"] else ""
            if counted is None:
                lines.append(f"{run_name}: failed: {summary.get('error')}")
                continue
            lines.append(
                f"{run_name}{mark}: prefill tokens {counted['prefill_tokens']:,}, "
                f"hit rate {counted['hit_rate'] or 0:.3f}, "
                f"preemptions {counted['preemptions']:,}"
            )
    return "\n".join(lines)


def timeline_figure(engines: Mapping[str, Any], title: str = "") -> Any:
    """Running requests (counted) and prefix hit rate so far (counted) over
    modeled time, one line per engine's best run; ``title`` says what ran
    (:func:`.header.plot_title`). Running requests are a count: whole-number
    ticks. The caller saves and closes the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, summary in best_runs(engines).items():
        points = summary.get("timeline") or []
        if not points:
            continue
        times = [p[0] for p in points]
        top.plot(times, [p[1] for p in points], label=name, linewidth=0.8)
        bottom.plot(times, [p[3] for p in points], label=name, linewidth=0.8)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("running requests (counted)")
    if title:
        fig.suptitle(title, fontsize="medium")
    bottom.set_ylabel("prefix hit rate so far (counted)")
    bottom.set_xlabel("time, s (modeled)")
    top.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_timeline(engines: Mapping[str, Any], path: Path, title: str = "") -> None:
    """:func:`timeline_figure` as a PNG."""
    fig = timeline_figure(engines, title)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
