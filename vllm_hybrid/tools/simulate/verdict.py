"""One line per engine: better or worse than the better upstream, and where.

The question a comparison answers is whether an engine does better than
upstream vLLM as a user would run it. Of the upstream engines that ran
(``upstream``, ``upstream-best``), the one that computes fewer prefill
tokens is the reference (:func:`.report.better_upstream`). Every other
engine is compared with it on the figures whose better direction is plain
(:data:`VERDICT_KEYS`, marked in :data:`.report.ROWS`): a figure within
:data:`TOLERANCE` of the reference's counts as the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hybrid.tools.simulate.report import (
    HIGHER,
    ROWS,
    best_runs,
    better_upstream,
    flat_figures,
)

#: The figures a verdict weighs (keys of :data:`.report.ROWS`).
VERDICT_KEYS = (
    "prefill_tokens",
    "preemptions",
    "ttft_p50",
    "ttft_p99",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "copy_gb",
)
#: Ratios within this of 1 are "the same".
TOLERANCE = 0.02
#: Short names of the figures in a verdict line.
SHORT = {
    "prefill_tokens": "prefill tokens",
    "preemptions": "preemptions",
    "ttft_p50": "TTFT p50",
    "ttft_p99": "TTFT p99",
    "tpot_p50_ms": "TPOT p50",
    "tpot_p99_ms": "TPOT p99",
    "copy_gb": "bytes copied",
}


def _compare(value: Any, ref: Any, higher: bool) -> tuple[int, str] | None:
    """(+1 better, -1 worse, 0 same) and the ratio text, or None if either
    figure is missing."""
    if value is None or ref is None:
        return None
    if ref == 0:
        if value == 0:
            return 0, "same"
        return (1 if higher else -1), f"{value:,.3g} vs 0"
    ratio = value / ref
    if abs(ratio - 1) <= TOLERANCE:
        return 0, f"{ratio:.2f}x"
    gain = ratio > 1 if higher else ratio < 1
    return (1 if gain else -1), f"{ratio:.2f}x"


def verdict(figures: Mapping[str, Any], ref: Mapping[str, Any]) -> tuple[str, str]:
    """(word, details) of one engine's figures against the reference's:
    which figures are better, worse, or the same within :data:`TOLERANCE`
    (two zeros say nothing and are left out)."""
    rows = {row.key: row for row in ROWS}
    better, worse, same = [], [], []
    for key in VERDICT_KEYS:
        row = rows[key]
        value, reference = figures[row.section].get(key), ref[row.section].get(key)
        outcome = _compare(value, reference, row.better == HIGHER)
        if outcome is None or (value == 0 and reference == 0):
            continue
        text = f"{SHORT[key]} {outcome[1]}"
        {1: better, -1: worse, 0: same}[outcome[0]].append(text)
    word = (
        "mixed against"
        if better and worse
        else "better than"
        if better
        else "worse than"
        if worse
        else "the same as"
    )
    parts = []
    if better and worse:
        parts = [f"better {', '.join(better)}", f"worse {', '.join(worse)}"]
    elif better or worse:
        parts = [", ".join(better or worse)]
    if same:
        parts.append(f"within {TOLERANCE:.0%}: {', '.join(same)}")
    return word, "; ".join(parts)


def verdict_lines(engines: Mapping[str, Any]) -> list[str]:
    """One line per engine other than the better upstream."""
    reference = better_upstream(engines)
    if reference is None:
        return []
    runs = best_runs(engines)
    ref = flat_figures(runs[reference])
    lines = [
        f"Verdicts against {reference} (the better upstream engine here; "
        f"figures within {TOLERANCE:.0%} count as the same):"
    ]
    for name, summary in runs.items():
        if name == reference:
            continue
        if "error" in summary:
            lines.append(f"  {name}: failed ({summary['error']})")
            continue
        word, details = verdict(flat_figures(summary), ref)
        lines.append(f"  {name}: {word} {reference}: {details}")
    return lines
