"""Command line of the serving benchmark (``python benchmarks/serve``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .config import KV_CACHE_DTYPES, MODELS, MODES, BenchConfig, quick
from .plot import plot
from .report import document, ratio_rows, ratio_table, results_table
from .runner import ServerResult, run_all


def _names(allowed: Sequence[str]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"choose from {', '.join(allowed)} (got {text!r})"
            )
        return names

    return parse


def _rates(text: str) -> tuple[float, ...]:
    """``1,2,inf``: requests per second; ``inf`` sends all at once."""
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (got {text!r})")
    return rates


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    pair = (int(low), int(high or low))
    if pair[0] < 1 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"want MIN,MAX with 1 <= MIN <= MAX: {text!r}")
    return pair


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python benchmarks/serve",
        description="Serving benchmark over vLLM's OpenAI server: pooled mode and "
        "upstream (VLLM_HYBRID_KV=0) at the same KV byte budget, same seeded "
        "streaming load at fixed Poisson rates and at saturation; prints "
        "throughput, TTFT/TPOT percentiles, prefix-cache hit rates and ratios.",
    )
    p.add_argument("--models", type=_names(MODELS), default=d.models)
    p.add_argument("--modes", type=_names(tuple(MODES)), default=d.modes)
    p.add_argument("--dtypes", type=_names(KV_CACHE_DTYPES), default=d.dtypes)
    p.add_argument(
        "--rates", type=_rates, default=None, help="req/s, 'inf' = all at once"
    )
    p.add_argument("--requests", type=int, default=None, help="requests per rate")
    p.add_argument("--output-len", type=_range, default=None, help="MIN,MAX tokens")
    p.add_argument("--shared-prefix-len", type=int, default=d.load.shared_prefix_len)
    p.add_argument("--shared-fraction", type=float, default=d.load.shared_fraction)
    p.add_argument("--kv-cache-mib", type=float, default=d.kv_cache_mib)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument(
        "--quick",
        action="store_true",
        help="rates 4,inf, 10 requests, 16-32 output tokens: checks the harness",
    )
    p.add_argument(
        "--force-upstream-turboquant",
        action="store_true",
        help="start upstream with TurboQuant although its CPU attention cannot "
        "store it (a failure is then reported, not fatal)",
    )
    p.add_argument("--compile", action="store_true", help="no --enforce-eager")
    p.add_argument("--model-dir", type=Path, default=d.model_dir)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, help="write everything to this file")
    p.add_argument("--plot", type=Path, help="write a throughput/latency PNG")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Defaults, then ``--quick``, then any option given explicitly."""
    cfg = BenchConfig()
    if args.quick:
        cfg = quick(cfg)
    load = replace(
        cfg.load,
        shared_prefix_len=args.shared_prefix_len,
        shared_fraction=args.shared_fraction,
    )
    if args.requests is not None:
        load = replace(load, requests=args.requests)
    if args.output_len is not None:
        load = replace(load, output_len=args.output_len)
    if load.requests < 1:
        raise SystemExit("bench_serve: --requests must be >= 1")
    return replace(
        cfg,
        models=args.models,
        modes=args.modes,
        dtypes=args.dtypes,
        rates=args.rates if args.rates is not None else cfg.rates,
        load=load,
        kv_cache_mib=args.kv_cache_mib,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        request_timeout=args.request_timeout,
        force_upstream_turboquant=args.force_upstream_turboquant,
        compile=args.compile,
        model_dir=args.model_dir,
        log_dir=args.log_dir,
    )


def capacity(result: ServerResult) -> str:
    """The server's own "KV cache size" log line, without its log prefix."""
    line = next((x for x in result.plan_lines if "KV cache size" in x), "")
    return line.split("] ", 1)[-1]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.perf_counter()
    results, probe, log_dir = run_all(cfg, log)
    rows = ratio_rows(results, cfg.rates)
    ok = all(r.status in ("ok", "not_runnable") for r in results)
    print(
        f"== bench_serve: KV {cfg.kv_cache_mib:g} MiB, max_model_len "
        f"{cfg.max_model_len}, max_num_seqs {cfg.max_num_seqs}, "
        f"{cfg.load.requests} requests per rate, seed {cfg.seed}; "
        f"{time.perf_counter() - started:.0f} s; logs {log_dir} =="
    )
    print(results_table(results))
    print()
    print("ratios (>1 better: req/s tok/s hit run; <1 better: TTFT TPOT)")
    print(ratio_table(rows))
    for result in results:
        if result.startup_s:
            started_in = f"started in {result.startup_s:.1f} s"
            print(f"{result.name}: {started_in}; {capacity(result)}")
    if args.json:
        doc = document(cfg, results, rows, probe, log_dir, ok)
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        title = (
            f"bench_serve: KV {cfg.kv_cache_mib:g} MiB, {cfg.load.requests} req/rate"
        )
        plot(results, args.plot, title)
    if not ok:
        failed = [f"{r.name}: {r.reason}" for r in results if r.status == "failed"]
        print("FAILED:\n  " + "\n  ".join(failed))
    return 0 if ok else 1
