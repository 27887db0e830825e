"""Command line of the serving benchmark (``python benchmarks/serve``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from benchmarks.harness import KV_CACHE_DTYPES, MODELS
from testing.loopback import MODES

from .config import BenchConfig, quick
from .report import document, ratio_rows, ratio_table, results_table
from .run import run_all


def _rate(text: str) -> float:
    """Requests per second; ``inf`` sends all at once."""
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (got {text!r})")
    return rate


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python benchmarks/serve",
        description="vLLM's serving benchmark against pooled mode and upstream "
        "(VLLM_HYBRID_KV=0) at the same KV byte budget, one live server each; "
        "prints its throughput and TTFT/TPOT percentiles with the servers' "
        "prefix-cache hit rates, preemptions, peak running requests and ratios.",
    )
    p.add_argument("--models", nargs="+", choices=MODELS, default=d.models)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=d.modes)
    p.add_argument("--dtypes", nargs="+", choices=KV_CACHE_DTYPES, default=d.dtypes)
    p.add_argument("--rates", nargs="+", type=_rate, help="req/s; inf: all at once")
    p.add_argument("--requests", type=int, help="requests per rate (default 40)")
    load = "vllm bench serve dataset options replacing the default load"
    p.add_argument("--dataset-args", type=shlex.split, help=load)
    p.add_argument("--kv-cache-mib", type=float, default=d.kv_cache_mib)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--seed", type=int, default=d.seed)
    quick_help = "rates 4,inf, 10 requests, 16-32 output tokens: checks the harness"
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--compile", action="store_true", help="no --enforce-eager")
    p.add_argument("--model-dir", type=Path, default=d.model_dir)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, help="write everything to this file")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Defaults, then ``--quick``, then any option given explicitly (every
    option but ``--quick`` and ``--json`` is the field of the same name)."""
    cfg = quick(BenchConfig()) if args.quick else BenchConfig()
    given = {f.name: getattr(args, f.name) for f in fields(cfg) if f.name in args}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    cfg = replace(cfg, **{k: v for k, v in given.items() if v not in (None, ())})
    if cfg.requests < 1:
        raise SystemExit("bench_serve: --requests must be >= 1")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    results, log_dir = run_all(cfg, lambda line: print(line, file=sys.stderr))
    rows = ratio_rows(results, cfg.rates)
    ok = all(r.status in ("ok", "not_run") for r in results)
    print(
        f"bench_serve: KV {cfg.kv_cache_mib:g} MiB, max_model_len "
        f"{cfg.max_model_len}, max_num_seqs {cfg.max_num_seqs}, {cfg.requests} "
        f"requests per rate, seed {cfg.seed}; logs {log_dir}\n"
    )
    print(results_table(results) + "\n")
    print(ratio_table(rows) + "\n")
    for r in results:
        if r.capacity:
            print(f"{r.name}: {r.capacity}")
    if args.json:
        args.json.write_text(json.dumps(document(cfg, results, rows, ok), indent=1))
    return 0 if ok else 1
