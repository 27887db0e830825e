"""The serving benchmark ``benchmarks/serve``: what it hands vLLM's serving
benchmark, the numbers it adds from ``/metrics``, its ratios and tables
without a server, and one ``--quick`` run of the command on the tiny
``qwen3_5`` in both modes (slow).

Arguments that differ between the modes, a counter delta or a ratio taken
the wrong way round would skew every number the benchmark prints without
failing it, so these are pinned down here.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from benchmarks.harness import REPO_ROOT, server_args
from benchmarks.serve import cli, config, report, run
from testing.loopback import Metrics


def _vllm_args(argv):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


# -- what vLLM's benchmark gets


def test_every_server_gets_the_same_load_and_each_rate_its_own_prompts():
    cfg = config.BenchConfig()
    one = cfg.bench_args("http://a:1", "/m", 2.0)
    assert one == cfg.bench_args("http://a:1", "/m", 2.0)
    # another server: only its address differs
    other = cfg.bench_args("http://b:2", "/m", 2.0)
    assert [a for a in one if a not in other] == ["--base-url=http://a:1"]
    # another rate: another seed, so no prefix hits from the rate before
    seeds = {config.rate_seed(0, r) for r in (*cfg.rates, 4.0)}
    assert len(seeds) == len(cfg.rates) + 1
    assert config.rate_seed(0, math.inf) != config.rate_seed(1, math.inf)
    warm = config.warmup(cfg).bench_args("http://a:1", "/m", math.inf)
    assert f"--seed={config.rate_seed(0, math.inf)}" not in warm


def test_vllm_reads_the_arguments_as_the_documented_load():
    args = _vllm_args(config.BenchConfig().bench_args("http://a:1", "/m", math.inf))
    assert (args.backend, args.base_url, args.model) == ("vllm", "http://a:1", "/m")
    assert args.dataset_name == "random" and args.num_prompts == 40
    assert (args.random_prefix_len, args.random_input_len) == (576, 144)
    assert args.random_output_len == 64
    assert json.loads(args.random_range_ratio) == {"input": 0.75, "output": 0.5}
    assert math.isinf(args.request_rate) and args.temperature == 0
    assert args.ignore_eos and args.save_detailed
    # no probe or warm-up request of its own: they would cache the prefix
    assert args.ready_check_timeout_sec == 0 and args.num_warmups == 0
    assert args.metric_percentiles == "50,90,99"
    quick = config.quick(config.BenchConfig())
    args = _vllm_args(quick.bench_args("http://a:1", "/m", 4.0))
    assert args.num_prompts == 10 and args.request_rate == 4.0
    assert json.loads(args.random_range_ratio)["output"] == 0.34


def test_server_args_differ_only_in_the_dtype():
    cfg = config.BenchConfig(kv_cache_mib=24)
    auto, tq = server_args(cfg, "auto"), server_args(cfg, "turboquant_k8v4")
    assert [a for a in auto if a not in tq] == ["--kv-cache-dtype=auto"]
    assert f"--kv-cache-memory-bytes={24 * 2**20}" in auto
    assert "--enforce-eager" in auto and "--mamba-ssm-cache-dtype=float32" in auto


def test_quick_and_explicit_options_combine():
    args = cli.build_parser().parse_args(["--quick", "--requests", "7"])
    cfg = cli.config_from_args(args)
    assert (cfg.requests, cfg.rates) == (7, (4.0, math.inf))
    assert cfg.dataset_args == config.QUICK_DATASET_ARGS
    argv = ["--rates", "1", "inf", "--models", "qwen3_next"]
    argv += ["--dataset-args", "--dataset-name=random x"]
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert (cfg.rates, cfg.models) == ((1.0, math.inf), ("qwen3_next",))
    assert cfg.dataset_args == ("--dataset-name=random", "x")
    assert cfg.modes == ("pooled", "upstream") and cfg.requests == 40
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--rates", "0"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--models", "llama"])


# -- what the benchmark adds from /metrics


def _metrics(**values) -> Metrics:
    names = {
        "queries": "vllm:prefix_cache_queries_total",
        "hits": "vllm:prefix_cache_hits_total",
        "preempted": "vllm:num_preemptions_total",
        "running": "vllm:num_requests_running",
    }
    lines = [
        f'{names[key]}{{engine="{engine}"}} {value}'
        for key, value in values.items()
        for engine in (0, 1)
    ]
    lines += [
        'vllm_hybrid:kv_pool_used_bytes{engine="0",pool="token"} 1024',
        'vllm_hybrid:kv_pool_used_bytes{engine="0",pool="state"} 2048',
    ]
    return Metrics.parse("\n".join(lines) + "\n")


def test_counter_deltas_give_the_runs_hit_rate_and_preemptions():
    before = _metrics(queries=100, hits=40, preempted=3)
    after = _metrics(queries=400, hits=190, preempted=5)
    # both engines' counters: (380 - 80) hits of (800 - 200) queries
    assert run.counter_deltas(before, after) == {
        "prefix_hit_rate": 0.5,
        "preemptions": 4.0,
    }
    assert run.counter_deltas(before, before)["prefix_hit_rate"] is None


def test_peaks_keep_the_largest_read():
    peaks: dict[str, float] = {}
    run.peaks_of(_metrics(running=3), peaks)
    run.peaks_of(_metrics(running=1), peaks)
    assert peaks == {
        "peak_running": 6.0,
        "peak_token_used_bytes": 1024.0,
        "peak_state_used_bytes": 2048.0,
    }


# -- ratios and tables


def rate_run(rate, tok_s, tpot, failed=0):
    values = {
        "completed": 10 - failed,
        "failed": failed,
        "request_throughput": tok_s / 10,
        "output_throughput": tok_s,
        "p50_ttft_ms": 100.0,
        "p50_tpot_ms": tpot,
        "prefix_hit_rate": 0.5,
        "peak_running": 4.0,
        "preemptions": 0.0,
    }
    return run.RateRun(rate, values, ["boom"] if failed else [])


def server(mode, dtype, runs, status="ok", reason=""):
    return run.ServerResult("qwen3_5", mode, dtype, status, reason, runs=runs)


def test_ratio_rows_compare_modes_then_dtypes_where_both_ran_cleanly():
    results = [
        server(
            "pooled", "auto", [rate_run("1", 200.0, 20.0), rate_run("inf", 300, 30)]
        ),
        server(
            "upstream",
            "auto",
            [rate_run("1", 100.0, 10.0), rate_run("inf", 150.0, 40.0, failed=1)],
        ),
        server("pooled", "turboquant_k8v4", [rate_run("1", 100.0, 40.0)]),
        server("upstream", "turboquant_k8v4", [], status="not_run"),
    ]
    rows = report.ratio_rows(results, [1.0, math.inf])
    got = {(r.comparison, r.group, r.rate): r.values for r in rows}
    # the upstream saturation run had a failed request: no ratio for it
    assert set(got) == {
        ("pooled/upstream", "auto", "1"),
        ("turboquant_k8v4/auto", "pooled", "1"),
    }
    modes = got[("pooled/upstream", "auto", "1")]
    assert modes["output_throughput"] == 2.0
    assert modes["p50_tpot_ms"] == 2.0
    assert modes["prefix_hit_rate"] == 1.0
    # no preemption on either side: no ratio rather than a division by zero
    assert modes["preemptions"] is None and modes["p90_ttft_ms"] is None
    dtypes = got[("turboquant_k8v4/auto", "pooled", "1")]
    assert dtypes["output_throughput"] == 0.5
    assert dtypes["p50_tpot_ms"] == 2.0


def test_tables_show_runs_ratios_and_servers_that_did_not_run():
    results = [
        server("pooled", "auto", [rate_run("1", 200.0, 20.0)]),
        server("upstream", "auto", [rate_run("1", 100.0, 10.0, failed=2)]),
        server("upstream", "turboquant_k8v4", [], "not_run", "upstream cannot"),
    ]
    table = report.results_table(results).splitlines()
    assert table[2].startswith("| qwen3_5 | pooled | auto | 1 | 10/10 | 20.00 | 200.0")
    assert "| 1 | 8/10 |" in table[3]
    assert "| not_run | upstream cannot |" in table[4]
    ratios = report.ratio_table(report.ratio_rows(results[:1], [1.0]))
    assert len(ratios.splitlines()) == 2
    doc = report.document(config.BenchConfig(), results, [], ok=True)
    assert json.loads(json.dumps(doc, allow_nan=False))["bench_args"]["inf"]


# -- the command, live


@pytest.mark.slow
@pytest.mark.extended
def test_quick_run_of_both_modes(tmp_path):
    """``--quick`` on ``qwen3_5`` with bf16 in both modes: every request
    completes with all its tokens, the servers' counters and peaks are
    there, the JSON has the pooled/upstream ratio rows.

    The KV budget is raised to 256 MiB so that all ten requests of a rate fit
    at once with room to spare: no preemption can then happen, and a
    preemption count other than 0 is a scheduling or counting bug."""
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "serve"), "--quick"]
    cmd += ["--models", "qwen3_5", "--dtypes", "auto", "--json", str(out)]
    cmd += ["--kv-cache-mib", "256"]
    cmd += ["--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    servers = {(s["mode"], s["dtype"]): s for s in doc["servers"]}
    assert set(servers) == {("pooled", "auto"), ("upstream", "auto")}
    # the longest request of --quick: the 576-token prefix, 144 * 1.75 tokens
    # of its own and 24 * 1.34 output tokens (vLLM rounds both up)
    longest = 576 + 252 + 33
    for s in servers.values():
        assert s["status"] == "ok", s["reason"]
        assert s["clean_shutdown"] is True
        # "KV cache size: N tokens": twice the ten longest requests, so their
        # state blocks fit beside them too
        capacity = re.search(r"KV cache size: ([\d,]+) tokens", s["capacity"])
        assert int(capacity.group(1).replace(",", "")) >= 2 * 10 * longest
        assert [r["rate"] for r in s["runs"]] == ["4", "inf"]
        for r in s["runs"]:
            v = r["values"]
            assert (v["completed"], v["failed"], r["errors"]) == (10, 0, [])
            assert v["request_throughput"] > 0 and v["output_throughput"] > 0
            assert 0 < v["p50_ttft_ms"] <= v["p99_ttft_ms"]
            assert 0 < v["p50_tpot_ms"] <= v["p99_tpot_ms"]
            # every prompt after the first of a rate starts with its prefix
            assert 0 < v["prefix_hit_rate"] < 1
            assert 1 <= v["peak_running"] <= 10 and v["preemptions"] == 0
        pooled = s["mode"] == "pooled"
        assert ("peak_state_used_bytes" in s["runs"][0]["values"]) is pooled
    ratios = {(r["comparison"], r["rate"]) for r in doc["ratios"]}
    assert ratios == {("pooled/upstream", "4"), ("pooled/upstream", "inf")}
    assert "pooled/upstream" in done.stdout
