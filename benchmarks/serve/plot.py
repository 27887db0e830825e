"""Throughput against latency, one panel per model and latency metric."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .runner import ServerResult

#: Latency metrics on the y axis, one row of panels each.
Y_METRICS = (
    ("tpot_p50_ms", "TPOT p50 (ms)"),
    ("ttft_p50_ms", "TTFT p50 (ms, log)"),
)
MODE_COLORS = {"pooled": "tab:blue", "upstream": "tab:orange"}
DTYPE_STYLES = {"auto": ("-", "o"), "turboquant_k8v4": ("--", "s")}


def _points(result: ServerResult, key: str) -> list[tuple[float, float, str]]:
    """(output tok/s, metric, rate) of the runs without failed requests, in
    the order run (rising rate, saturation last)."""
    out = []
    for run in result.runs:
        flat = run.flat()
        x, y = flat["output_tok_per_s"], flat[key]
        if run.errors == 0 and x is not None and y is not None:
            out.append((x, y, run.rate))
    return out


def _label(result: ServerResult) -> str:
    """Mode and dtype; a server that failed says so (its later rates, and
    the run that failed, have no point)."""
    label = f"{result.mode} {result.dtype}"
    return label if result.status == "ok" else f"{label} ({result.status})"


def plot(results: Sequence[ServerResult], path: Path, title: str = "") -> Path:
    """Write a PNG: x output tokens/s, y latency; a line per mode x dtype
    (colour: mode, line style: dtype), each point labelled with its rate.
    Upper left is worse: down and to the right is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    fig, axes = plt.subplots(
        len(Y_METRICS),
        max(1, len(models)),
        figsize=(6.0 * max(1, len(models)), 4.2 * len(Y_METRICS)),
        squeeze=False,
    )
    for col, model in enumerate(models):
        for row, (key, label) in enumerate(Y_METRICS):
            ax = axes[row][col]
            for result in (r for r in results if r.model == model):
                pts = _points(result, key)
                if not pts:
                    continue
                style, marker = DTYPE_STYLES.get(result.dtype, (":", "^"))
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    linestyle=style,
                    marker=marker,
                    color=MODE_COLORS.get(result.mode, "tab:gray"),
                    label=_label(result),
                )
                for x, y, rate in pts:
                    ax.annotate(
                        "sat" if rate == "inf" else f"{rate}/s",
                        (x, y),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                    )
            if key.startswith("ttft"):
                ax.set_yscale("log")
            ax.set_title(f"{model}: {label}")
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
