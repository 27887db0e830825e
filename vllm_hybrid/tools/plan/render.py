"""Output of a plan: the side-by-side table and the concurrency PNG.

JSON output is :meth:`Plan.to_json`.
"""

from __future__ import annotations

from pathlib import Path

from vllm_hybrid.tools.plan.compute import ModePlan, Plan
from vllm_hybrid.tools.plan.request import PlanError


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.2f} MiB"


def _groups_text(plan: ModePlan) -> str:
    if not plan.groups:
        return "-"
    counts: dict[tuple[str, int], int] = {}
    for g in plan.groups:
        key = (g["kind"], g["layers"])
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(
        f"{n} {kind} x {layers} layers" for (kind, layers), n in counts.items()
    )


def _pools_text(plan: ModePlan) -> str:
    return "; ".join(
        f"{p['kind']} {p['num_blocks']:,} x {p['block_bytes']:,} B" for p in plan.pools
    )


def _padding_text(plan: ModePlan) -> str:
    if plan.state_padding_bytes is None:
        return "-"
    return f"{plan.state_padding_bytes:,} B ({plan.state_padding_pct:.2f}%)"


def _graphs_text(plan: ModePlan) -> str:
    graphs = plan.cuda_graphs
    if graphs is None:
        return "-"
    rows, states = graphs["graph_rows"], graphs["states"]
    if graphs["refused"]:
        return (
            f"refuses to start: max_num_seqs {graphs['max_num_seqs']} > "
            f"{plan.num_blocks:,} blocks"
        )
    if graphs["cap"] is not None:
        return f"capped at {graphs['cap']} seqs (of {rows}: {states} states)"
    what = "blocks" if plan.mode == "upstream" else "states"
    return f"up to {rows} seqs ({states:,} {what})"


def _rows(plan: Plan) -> list[tuple[str, str, str]]:
    up, po = plan.upstream, plan.pooled

    def both(fn) -> tuple[str, str]:
        return tuple(  # type: ignore[return-value]
            (f"not possible: {m.error}" if m.error else fn(m)) for m in (up, po)
        )

    def opt(value, fmt="{:,}") -> str:
        return "-" if value is None else fmt.format(value)

    rows = [
        ("KV cache groups", *both(_groups_text)),
        ("attention block (tokens)", *both(lambda m: opt(m.attention_block_size))),
        ("attention page", *both(lambda m: opt(m.attention_page_bytes, "{:,} B"))),
        ("state page", *both(lambda m: opt(m.state_page_bytes, "{:,} B"))),
        ("state padding", *both(_padding_text)),
        ("pools (blocks x bytes)", *both(_pools_text)),
        ("full CUDA graphs", *both(_graphs_text)),
        ("token capacity (logged)", *both(lambda m: opt(m.token_capacity))),
        (
            "longest single request",
            *both(lambda m: opt(m.max_tokens_one_request)),
        ),
        (
            f"max concurrency @ {plan.max_model_len:,}",
            *both(lambda m: opt(m.max_concurrency, "{:.2f}x")),
        ),
    ]
    for length in plan.prompt_lens:
        rows.append(
            (
                f"concurrency @ {length:,} tokens",
                *both(
                    lambda m, n=length: (
                        f"{m.at_prompt_len[n]['max_concurrency']:.2f}x "
                        f"({_mib(m.at_prompt_len[n]['bytes_per_request'])}/req)"
                    )
                ),
            )
        )
    return rows


def render_table(plan: Plan) -> str:
    """The human-readable plan."""
    name = plan.preset or plan.model
    head = (
        f"{name} ({plan.architecture}, {plan.attention_layers} attention + "
        f"{plan.state_layers} state layers) on {plan.device}, TP "
        f"{plan.tensor_parallel_size}, kv_cache_dtype {plan.kv_cache_dtype}, "
        f"KV budget {_mib(plan.kv_cache_memory)} per GPU, max_model_len "
        f"{plan.max_model_len:,}, max_num_seqs {plan.max_num_seqs}, prefix "
        f"caching {'on' if plan.prefix_caching else 'off'}"
        + (f" (mamba_cache_mode {plan.mamba_cache_mode})" if plan.hybrid else "")
    )
    rows = [("", "upstream vLLM 0.32", "vllm-hybrid pooled"), *_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [head]
    if plan.serve_command:
        lines.append(f"planned for: {plan.serve_command}")
    lines.append("")
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) for cell, w in zip(row, widths, strict=True)
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for note in (*plan.notes, plan.upstream.note, plan.pooled.note):
        if note:
            lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_concurrency(plan: Plan, path: Path) -> None:
    """PNG of max concurrency against prompt length, both modes."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlanError(
            "--plot needs matplotlib: pip install vllm-hybrid[plot]"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in (plan.upstream, plan.pooled):
        if mode.error:
            continue
        lens = sorted(mode.at_prompt_len)
        ax.plot(
            lens,
            [mode.at_prompt_len[n]["max_concurrency"] for n in lens],
            marker="o",
            label="upstream vLLM 0.32" if mode.mode == "upstream" else "pooled mode",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per request")
    ax.set_ylabel("max concurrent requests")
    ax.set_title(
        f"{plan.preset or Path(plan.model).name}: {plan.device}, TP "
        f"{plan.tensor_parallel_size}, {plan.kv_cache_dtype}, "
        f"{plan.kv_cache_memory / 2**30:.2f} GiB KV"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
