"""What ``vllm-hybrid simulate`` says: the header, the better direction of
each row, the note on small samples, one verdict per engine against the
better upstream engine, the plot's title and ticks, ``vllm bench serve``'s
key names in the JSON and the per-request lines. No engine is started: the
figures are made up, and checked against numbers worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_hybrid.tools.plan.compute import ModePlan, Plan
from vllm_hybrid.tools.plan.request import GPU_BUDGET_OPTIONS, PlanRequest
from vllm_hybrid.tools.simulate.cli import write_per_request
from vllm_hybrid.tools.simulate.drive import DriveResult, RequestTiming
from vllm_hybrid.tools.simulate.header import plot_title, render_header
from vllm_hybrid.tools.simulate.metrics import bench_serve_metrics, per_request
from vllm_hybrid.tools.simulate.preflight import WorkloadFacts
from vllm_hybrid.tools.simulate.report import render_table, timeline_figure
from vllm_hybrid.tools.simulate.session import summarize
from vllm_hybrid.tools.simulate.spec import SimulationSpec, WorkloadSpec
from vllm_hybrid.tools.simulate.steps import StepRecord
from vllm_hybrid.tools.simulate.verdict import verdict_lines

GiB = 2**30


def _run(prefill: int, ttft: tuple[float, float], n: int = 1000, **counted) -> dict:
    return {
        "counted": {
            "prefill_tokens": prefill,
            "hit_tokens": 1000,
            "hit_rate": 0.1,
            "outcome": "finished",
            "peak_running": 10,
            "preemptions": counted.pop("preemptions", 0),
            "copy_bytes": counted.pop("copy_bytes", 2e9),
            **counted,
        },
        "modeled": {
            "ttft_s": {"p50": ttft[0], "p99": ttft[1], "n": n},
            "tpot_s": {"p50": 0.010, "p99": 0.050, "n": n},
        },
        "timeline": [(0.0, 1, 0, 0.0), (1.5, 3, 1, 0.1), (3.0, 2, 0, 0.2)],
    }


def _engines(**runs: dict) -> dict:
    return {name: {"best": name, "runs": {name: run}} for name, run in runs.items()}


# --------------------------------------------------------------------------
# verdicts and the table
# --------------------------------------------------------------------------


def test_verdicts_are_against_the_better_upstream_engine():
    """upstream-best computes fewer prefill tokens than upstream here, so it
    is the reference; pooled is better on prefill and TTFT, worse on
    preemptions; single-pool is within 2% everywhere."""
    engines = _engines(
        upstream=_run(1_000_000, (0.50, 3.0)),
        **{"upstream-best": _run(900_000, (0.60, 3.0))},
        pooled=_run(810_000, (0.30, 3.03), preemptions=2),
        **{"single-pool": _run(905_000, (0.60, 3.0))},
    )
    lines = verdict_lines(engines)
    assert lines[0].startswith("Verdicts against upstream-best (the better upstream")
    assert lines[1:] == [
        "  upstream: mixed against upstream-best: better TTFT p50 0.83x; worse "
        "prefill tokens 1.11x; within 2%: TTFT p99 1.00x, TPOT p50 1.00x, TPOT "
        "p99 1.00x, bytes copied 1.00x",
        "  pooled: mixed against upstream-best: better prefill tokens 0.90x, "
        "TTFT p50 0.50x; worse preemptions 2 vs 0; within 2%: TTFT p99 1.01x, "
        "TPOT p50 1.00x, TPOT p99 1.00x, bytes copied 1.00x",
        "  single-pool: the same as upstream-best: within 2%: prefill tokens "
        "1.01x, TTFT p50 1.00x, TTFT p99 1.00x, TPOT p50 1.00x, TPOT p99 1.00x, "
        "bytes copied 1.00x",
    ]
    only_pooled = _engines(upstream=_run(100, (1.0, 2.0)), pooled=_run(50, (0.5, 1.0)))
    assert verdict_lines(only_pooled)[1].startswith(
        "  pooled: better than upstream: prefill tokens 0.50x, TTFT p50 0.50x"
    )
    failed = _engines(upstream=_run(100, (1.0, 2.0)), pooled={"error": "boom"})
    assert verdict_lines(failed)[1] == "  pooled: failed (boom)"


def test_rows_are_marked_and_small_samples_starred():
    engines = _engines(
        upstream=_run(100, (1.0, 2.0), n=20), pooled=_run(50, (0.5, 1.0), n=20)
    )
    table = render_table(engines)
    assert "| prefill tokens computed (counted) ↓ | 100 | 50 (0.50x) |" in table
    assert "| TTFT p99, s (modeled) ↓ | 2.00 * | 1.00 (0.50x) * |" in table
    assert "| peak running (counted) | 10 | 10 (1.00x) |" in table
    assert (
        "* a percentile of fewer than 100 requests (upstream 20, pooled 20): a "
        "p99 of them is close to their largest value."
    ) in table
    large = render_table(_engines(upstream=_run(100, (1.0, 2.0), n=100)))
    assert "*" not in large


def test_the_plot_has_a_title_and_whole_number_ticks():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    engines = _engines(upstream=_run(100, (1.0, 2.0)), pooled=_run(50, (0.5, 1.0)))
    fig = timeline_figure(engines, "qwen, 80 GiB\nMooncake")
    try:
        assert fig._suptitle.get_text() == "qwen, 80 GiB\nMooncake"
        top = fig.axes[0]
        fig.canvas.draw()
        ticks = [t for t in top.get_yticks() if top.get_ylim()[0] <= t]
        assert ticks and all(float(t).is_integer() for t in ticks)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------
# the header
# --------------------------------------------------------------------------


def _plan() -> Plan:
    mode = ModePlan("upstream")
    return Plan(
        model="qwen3.6-35b-a3b-fp8",
        architecture="Qwen3_5MoeForCausalLM",
        preset="qwen3.6-35b-a3b-fp8",
        device="cuda",
        kv_cache_dtype="turboquant_k8v4",
        tensor_parallel_size=1,
        kv_cache_memory=41_446_434_406,
        max_model_len=262_144,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        prefix_caching=True,
        mamba_cache_mode="align",
        hybrid=True,
        attention_layers=10,
        state_layers=30,
        prompt_lens=[262_144],
        notes=[],
        upstream=mode,
        pooled=mode,
        serve_command="vllm serve Qwen/Qwen3.6-35B-A3B-FP8 --kv-cache-dtype "
        "turboquant_k8v4",
    )


def test_the_header_says_what_ran():
    request = PlanRequest(
        "qwen3.6-35b-a3b-fp8",
        kv_cache_memory=41_446_434_406,
        kv_cache_dtype="turboquant_k8v4",
        gpu_memory_gib=80,
        budget_options=GPU_BUDGET_OPTIONS,
        weights_bytes=35 * GiB,
        gpu_memory_utilization=0.92,
    )
    spec = SimulationSpec(request, WorkloadSpec(requests=1000))
    facts = WorkloadFacts(
        "the Mooncake conversation trace (512-token hash ids)",
        12_031,
        1_000,
        330.2,
        cut_vendored=True,
    )
    lines = render_header(spec, _plan(), facts, ["upstream", "pooled"]).splitlines()
    assert lines[0] == (
        "Model: qwen3.6-35b-a3b-fp8 (Qwen3_5MoeForCausalLM, 10 attention + 30 "
        "state layers), TP 1, kv_cache_dtype turboquant_k8v4"
    )
    assert lines[1] == (
        "As served: vllm serve Qwen/Qwen3.6-35B-A3B-FP8 --kv-cache-dtype "
        "turboquant_k8v4"
    )
    assert lines[2].startswith(
        "KV budget: 39,526.40 MiB per GPU (--gpu-memory 80 GiB x 0.92 - 35.00 GiB "
        "of weights / TP 1;"
    )
    assert "max_num_seqs 1,024, max_num_batched_tokens 8,192" in lines[2]
    assert lines[3].startswith(
        "Clock: H100 SXM5 80GB data sheet (the profile closest to --gpu-memory 80;"
    )
    assert lines[4] == (
        "Workload: the Mooncake conversation trace (512-token hash ids): 1,000 of "
        "its 12,031 requests, arriving over 330 s; the whole hour: --requests all "
        "(12 times the requests, minutes an engine)"
    )
    assert lines[5].startswith("Engines: upstream (vLLM 0.32 as installed")
    title = plot_title(spec, _plan(), facts)
    assert title.startswith("qwen3.6-35b-a3b-fp8, turboquant_k8v4 KV, TP 1, H100")
    assert title.endswith("1,000 requests")


# --------------------------------------------------------------------------
# vllm bench serve's keys, the per-request lines
# --------------------------------------------------------------------------


def _timings() -> dict[str, RequestTiming]:
    """Three finished requests: TTFT 0.1, 0.2, 0.6 s; output 11, 1, 21
    tokens over 1.0, 0, 2.0 s after the first (TPOT 100 ms, none, 100 ms)."""
    return {
        "a": RequestTiming(0.0, 100, 0.1, 1.1, 11, 40),
        "b": RequestTiming(1.0, 50, 1.2, 1.2, 1, 0),
        "c": RequestTiming(2.0, 200, 2.6, 4.6, 21, 100),
    }


def test_bench_serve_keys_are_computed_as_vllm_bench_serve_computes_them():
    metrics = bench_serve_metrics(_timings(), makespan_s=5.0)
    ttft_ms = np.array([100.0, 200.0, 600.0])
    assert metrics["completed"] == 3 and metrics["duration"] == 5.0
    assert metrics["total_input_tokens"] == 350
    assert metrics["total_output_tokens"] == 33
    assert metrics["request_throughput"] == pytest.approx(3 / 5)
    assert metrics["output_throughput"] == pytest.approx(33 / 5)
    assert metrics["total_token_throughput"] == pytest.approx(383 / 5)
    assert metrics["mean_ttft_ms"] == pytest.approx(300.0)
    assert metrics["median_ttft_ms"] == pytest.approx(200.0)
    assert metrics["std_ttft_ms"] == pytest.approx(float(ttft_ms.std()))
    assert metrics["p99_ttft_ms"] == pytest.approx(float(np.percentile(ttft_ms, 99)))
    assert metrics["p99_ttft_ms"] == pytest.approx(592.0)
    assert metrics["median_tpot_ms"] == pytest.approx(100.0)
    e2el_p99 = float(np.percentile([1100, 200, 2600], 99))
    assert metrics["p99_e2el_ms"] == pytest.approx(e2el_p99)


def test_a_runs_summary_carries_the_bench_keys():
    result = DriveResult(StepRecord(prefill_tokens=210), _timings(), makespan_s=5.0)
    summary = summarize(result, 0.0, 0.0)
    assert summary["bench_serve"]["median_ttft_ms"] == pytest.approx(200.0)
    # the table's percentiles are the same numbers, in seconds
    assert summary["modeled"]["ttft_s"]["p50"] == pytest.approx(0.2)
    assert summary["modeled"]["ttft_s"]["n"] == 3


def test_per_request_lines_hold_each_requests_figures(tmp_path: Path):
    rows = per_request(_timings(), {"a": 60, "b": 50, "c": 100})
    assert [r["request_id"] for r in rows] == ["a", "b", "c"]
    first = rows[0]
    assert first["arrival_s"] == 0.0
    assert first["ttft_ms"] == pytest.approx(100.0)
    assert first["tpot_ms"] == pytest.approx(100.0)
    assert (first["prompt_tokens"], first["hit_tokens"], first["prefill_tokens"]) == (
        100,
        40,
        60,
    )
    assert rows[1]["tpot_ms"] is None  # one output token: no TPOT
    engines = {"pooled": {"best": "p", "runs": {"p": {"requests": rows, "x": 1}}}}
    out = tmp_path / "requests.jsonl"
    assert write_per_request(engines, out) == 3
    assert engines["pooled"]["runs"]["p"] == {"x": 1}  # moved out of the JSON
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[2] == {"engine": "pooled", "run": "p", **rows[2]}
