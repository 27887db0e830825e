"""The serving benchmark ``benchmarks/serve``: its pure parts (schedules,
prompts, percentiles, summaries, ratios, probe and log parsing, tables,
plot) without a server, and one ``--quick`` run of the command on the tiny
``qwen3_5`` in both modes (slow).

A wrong percentile, a schedule that differs between modes or a ratio taken
the wrong way round would skew every number the benchmark prints without
failing it, so these are pinned down here.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from engine_utils import BENCHMARKS
from serve import cli, config, metrics, plot, probe, report, runner, workload

VOCAB = list(range(3, 951))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- schedules and prompts


def test_poisson_schedule_is_seeded():
    one = workload.poisson_offsets(50, 2.0, random.Random("a"))
    assert one == workload.poisson_offsets(50, 2.0, random.Random("a"))
    assert one != workload.poisson_offsets(50, 2.0, random.Random("b"))
    assert one[0] == 0.0
    assert one == sorted(one)


def test_poisson_schedule_has_the_asked_rate():
    offsets = workload.poisson_offsets(4001, 4.0, random.Random(0))
    # 4,000 exponential gaps of mean 0.25 s: the mean is within 5% of it
    # with overwhelming probability, and the seed fixes the draw anyway.
    assert offsets[-1] / 4000 == pytest.approx(0.25, rel=0.05)


def test_saturation_sends_everything_at_once():
    assert workload.poisson_offsets(5, math.inf, random.Random(0)) == [0.0] * 5
    assert workload.poisson_offsets(0, 1.0, random.Random(0)) == []
    with pytest.raises(ValueError):
        workload.poisson_offsets(3, 0.0, random.Random(0))


def test_runs_are_the_same_for_every_server_and_shaped_as_asked():
    shape = config.LoadShape(requests=30)
    run = workload.plan_run(shape, VOCAB, seed=0, rate=2.0)
    assert run == workload.plan_run(shape, VOCAB, seed=0, rate=2.0)
    assert run != workload.plan_run(shape, VOCAB, seed=1, rate=2.0)
    # Another rate: other prompts (no hits from the previous run) and times.
    other = workload.plan_run(shape, VOCAB, seed=0, rate=math.inf)
    assert [r.prompt for r in other] != [r.prompt for r in run]
    assert {r.offset for r in other} == {0.0}
    prefixes: dict[int, tuple[int, ...]] = {}
    for req in run:
        assert set(req.prompt) <= set(VOCAB)
        low, high = shape.output_len
        assert low <= req.max_tokens <= high
        if req.prefix_group < 0:
            assert shape.unshared_len[0] <= len(req.prompt) <= shape.unshared_len[1]
            continue
        head = req.prompt[: shape.shared_prefix_len]
        assert prefixes.setdefault(req.prefix_group, head) == head
        suffix = len(req.prompt) - shape.shared_prefix_len
        assert shape.suffix_len[0] <= suffix <= shape.suffix_len[1]
    assert len(prefixes) == shape.prefix_groups
    assert sum(r.prefix_group >= 0 for r in run) > len(run) // 2
    assert workload.max_prompt_tokens(shape) <= config.BenchConfig().max_model_len


def test_ordinary_ids_leave_out_special_tokens(tmp_path):
    vocab = {f"t{i}": i for i in range(10)}
    added = [{"id": 0, "special": True}, {"id": 1, "special": True}]
    doc = {"model": {"vocab": vocab}, "added_tokens": added}
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    assert workload.ordinary_token_ids(tmp_path) == list(range(2, 10))


# -- percentiles, summaries, ratios


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert metrics.percentile(values, 50) == 3.0
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 100) == 5.0
    assert metrics.percentile(values, 90) == pytest.approx(4.6)
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 50) is None
    with pytest.raises(ValueError):
        metrics.percentile(values, 101)


def record(index, ttft, latency, tokens, error="", sent=0.0):
    rec = metrics.RequestRecord(index, 100, tokens, offset=0.0, sent=sent)
    rec.ttft, rec.latency, rec.output_tokens, rec.error = ttft, latency, tokens, error
    return rec


def test_tpot_is_time_after_the_first_token_per_later_token():
    assert record(0, 0.5, 2.5, 5).tpot == pytest.approx(0.5)
    assert record(0, 0.5, 0.5, 1).tpot is None
    assert record(0, 0.5, 2.5, 5, error="timeout").tpot is None


def test_summary_counts_completed_requests_over_the_whole_run():
    records = [
        record(0, 0.1, 1.1, 11, sent=0.0),
        record(1, 0.3, 2.3, 11, sent=0.25),
        record(2, None, None, 0, error="HTTP 500: boom"),
    ]
    before = metrics.CounterSnapshot(100.0, 40.0, 1.0)
    after = metrics.CounterSnapshot(300.0, 90.0, 3.0)
    peaks = {metrics.RUNNING: 2.0, metrics.WAITING: 1.0}
    s = metrics.summarize("2", records, 4.0, before, after, peaks)
    assert (s.requests, s.completed, s.errors) == (3, 2, 1)
    assert s.req_per_s == pytest.approx(0.5)
    assert s.output_tok_per_s == pytest.approx(22 / 4)
    assert s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.tpot_ms["p50"] == pytest.approx(150.0)  # 0.1 s and 0.2 s per token
    assert s.prefix_hit_rate == pytest.approx(0.25)
    assert (s.preemptions, s.peak_running, s.peak_waiting) == (2.0, 2.0, 1.0)
    assert s.max_send_lag_ms == pytest.approx(250.0)
    assert s.first_errors == ["#2: HTTP 500: boom"]
    flat = s.flat()
    assert {"req_per_s", "ttft_p99_ms", "tpot_p90_ms", "prefix_hit_rate"} <= set(flat)


def test_hit_rate_needs_queries():
    same = metrics.CounterSnapshot(10.0, 5.0, 0.0)
    assert metrics.hit_rate(same, same) is None


def test_ratio_is_numerator_over_denominator_or_none():
    assert metrics.ratio(3.0, 2.0) == 1.5
    assert metrics.ratio(3.0, 0.0) is None
    assert metrics.ratio(None, 2.0) is None
    assert metrics.ratio_values({"a": 2.0, "b": None}, {"a": 4.0, "b": 1.0}) == {
        "a": 0.5,
        "b": None,
    }


def test_metrics_text_is_summed_over_label_sets():
    text = (
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m x"} 12.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m x"} 3.0\n'
        "vllm:num_requests_running 2\n"
        "garbage line\n"
    )
    values = metrics.parse_metrics(text)
    assert values[metrics.PREFIX_HITS] == 15.0
    assert values[metrics.RUNNING] == 2.0
    assert metrics.CounterSnapshot.from_metrics(values).prefix_hits == 15.0


def summary(rate, tok_s, tpot, hit=0.5, errors=0):
    return metrics.RunSummary(
        rate=rate,
        requests=10,
        completed=10 - errors,
        errors=errors,
        duration_s=1.0,
        req_per_s=tok_s / 10,
        output_tok_per_s=tok_s,
        ttft_ms={"p50": 100.0, "p90": 200.0, "p99": 300.0},
        tpot_ms={"p50": tpot, "p90": tpot, "p99": tpot},
        prefix_hit_rate=hit,
        peak_running=4.0,
    )


def server(mode, dtype, runs, status="ok"):
    return runner.ServerResult("qwen3_5", mode, dtype, status=status, runs=runs)


def test_ratio_rows_compare_modes_then_dtypes_where_both_ran_cleanly():
    results = [
        server(
            "pooled", "auto", [summary("1", 200.0, 20.0), summary("inf", 300.0, 30.0)]
        ),
        server(
            "upstream",
            "auto",
            [summary("1", 100.0, 10.0), summary("inf", 150.0, 40.0, errors=1)],
        ),
        server("pooled", "turboquant_k8v4", [summary("1", 100.0, 40.0)]),
        server("upstream", "turboquant_k8v4", [], status="not_runnable"),
    ]
    rows = report.ratio_rows(results, [1.0, math.inf])
    got = {(r.comparison, r.group, r.rate): r.values for r in rows}
    # The upstream saturation run had a failed request: no ratio for it.
    assert set(got) == {
        ("pooled/upstream", "auto", "1"),
        ("turboquant_k8v4/auto", "pooled", "1"),
    }
    modes = got[("pooled/upstream", "auto", "1")]
    assert modes["output_tok_per_s"] == 2.0
    assert modes["tpot_p50_ms"] == 2.0
    assert modes["prefix_hit_rate"] == 1.0
    dtypes = got[("turboquant_k8v4/auto", "pooled", "1")]
    assert dtypes["output_tok_per_s"] == 0.5
    assert dtypes["tpot_p50_ms"] == 2.0


def test_tables_show_runs_ratios_and_unrunnable_rows():
    results = [
        server("pooled", "auto", [summary("1", 200.0, 20.0)]),
        server("upstream", "auto", [summary("1", 100.0, 10.0)]),
        runner.ServerResult(
            "qwen3_5",
            "upstream",
            "turboquant_k8v4",
            status="not_runnable",
            reason="not runnable upstream on CPU: no",
        ),
    ]
    table = report.results_table(results)
    assert "not runnable upstream on CPU: no" in table
    assert "200.0" in table
    ratios = report.ratio_table(report.ratio_rows(results, [1.0]))
    assert "pooled/upstream" in ratios and "2.00x" in ratios


def test_document_is_plain_json(tmp_path):
    cfg = config.BenchConfig()
    results = [server("pooled", "auto", [summary("inf", 200.0, 20.0)])]
    doc = report.document(cfg, results, [], {}, tmp_path, True)
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text)["config"]["rates"][-1] == "inf"


def test_plot_writes_a_png(tmp_path):
    results = [
        server(
            "pooled", "auto", [summary("1", 100.0, 20.0), summary("inf", 200.0, 30.0)]
        ),
        server("upstream", "auto", [summary("1", 90.0, 18.0)]),
    ]
    path = plot.plot(results, tmp_path / "p.png", "title")
    assert path.read_bytes()[:8] == PNG_MAGIC


# -- probe, logs, options


def test_probe_output_gives_one_verdict_per_dtype():
    line = probe.MARKER + json.dumps(
        {
            "backend": "CPU_ATTN",
            "stores": ["auto", "fp8"],
            "supported": {"turboquant_k8v4": False, "fp8": True},
        }
    )
    found = probe.verdicts_from_output(
        f"INFO noise\n{line}\n", ["turboquant_k8v4", "fp8"]
    )
    assert [v.supported for v in found] == [False, True]
    assert "CPU_ATTN" in found[0].reason and "auto, fp8" in found[0].reason
    assert found[1].reason == ""
    failed = probe.verdicts_from_output("Traceback\nImportError: x\n", ["fp8"])
    assert failed[0].supported is None
    assert "ImportError: x" in failed[0].reason


def test_reason_line_names_the_root_cause():
    log = "INFO start\nWARNING x\nTraceback (most recent call last):\nValueError: bad\n"
    assert runner.reason_line(log, "fallback") == "ValueError: bad"
    engine = "(EngineCore pid=2) ERROR 11-25 15:14:32 [core.py:1512]"
    api = "(APIServer pid=1) ERROR 11-25 15:14:32 [serving.py:500]"
    log = (
        "(APIServer pid=1) WARNING [x.py:1] raise the ulimit or get "
        "`OSError: [Errno 24] Too many open files`\n"
        f"{engine} Traceback (most recent call last):\n"
        f"{engine} ValueError: Cannot get 1 free blocks from the pool\n"
        f"{api} vllm.v1.engine.exceptions.EngineDeadError: EngineCore died\n"
    )
    assert runner.reason_line(log, "fallback") == (
        f"{engine} ValueError: Cannot get 1 free blocks from the pool"
    )
    assert runner.reason_line("INFO all fine\n", "exit 3\nmore") == "exit 3"


def test_reason_line_puts_a_crash_before_the_errors_it_causes():
    log = (
        "INFO: Application startup complete.\n"
        "!!!!!!! Segfault encountered !!!!!!!\n"
        '  File "./signal/../sysdeps/unix/sysv/linux/libc_sigaction.c", line 0\n'
        '  File "csrc/cpu/cpu_attn_vec.hpp", line 305, in reshape_and_cache\n'
        "(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: cancelled\n"
    )
    assert runner.reason_line(log, "fallback") == (
        "!!!!!!! Segfault encountered !!!!!!! "
        'File "csrc/cpu/cpu_attn_vec.hpp", line 305, in reshape_and_cache'
    )


def test_quick_and_explicit_options_combine():
    args = cli.build_parser().parse_args(["--quick", "--requests", "7"])
    cfg = cli.config_from_args(args)
    assert cfg.rates == config.quick(config.BenchConfig()).rates
    assert cfg.load.requests == 7
    args = cli.build_parser().parse_args(
        ["--rates", "0.5,inf", "--models", "qwen3_next"]
    )
    cfg = cli.config_from_args(args)
    assert cfg.rates == (0.5, math.inf) and cfg.models == ("qwen3_next",)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--rates", "0"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--models", "llama"])


def test_server_args_differ_only_in_the_dtype():
    cfg = replace(config.BenchConfig(), kv_cache_mib=24)
    auto, tq = cfg.server_args("auto"), cfg.server_args("turboquant_k8v4")
    assert [a for a in auto if a != "auto"] == [a for a in tq if a != "turboquant_k8v4"]
    assert str(24 * config.MIB) in auto and "--enforce-eager" in auto


# -- the command, live


@pytest.mark.slow
def test_quick_run_of_both_modes(tmp_path):
    """``--quick`` on ``qwen3_5`` with bf16 in both modes: every request
    completes, the numbers are positive, the JSON has the pooled/upstream
    ratio rows, the plot is a PNG."""
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [
        sys.executable,
        str(Path(BENCHMARKS) / "serve"),
        "--quick",
        "--models",
        "qwen3_5",
        "--dtypes",
        "auto",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    rates = [config.rate_key(r) for r in config.quick(config.BenchConfig()).rates]
    servers = {(s["mode"], s["dtype"]): s for s in doc["servers"]}
    assert set(servers) == {("pooled", "auto"), ("upstream", "auto")}
    for s in servers.values():
        assert s["status"] == "ok", s["reason"]
        assert [run["rate"] for run in s["runs"]] == rates
        for run in s["runs"]:
            assert run["completed"] == run["requests"] == 10
            assert run["errors"] == 0
            assert run["req_per_s"] > 0 and run["output_tok_per_s"] > 0
            assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
            assert 0 < run["tpot_ms"]["p50"] <= run["tpot_ms"]["p99"]
            assert run["peak_running"] >= 1
        # Every request generated exactly what it asked for.
        for reqs in s["requests"].values():
            assert all(r["output_tokens"] == r["max_tokens"] for r in reqs)
    ratios = {(r["comparison"], r["rate"]) for r in doc["ratios"]}
    assert ratios == {("pooled/upstream", rate) for rate in rates}
    for row in doc["ratios"]:
        assert row["values"]["output_tok_per_s"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "pooled/upstream" in done.stdout
