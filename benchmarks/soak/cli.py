"""Command line of the soak (``python benchmarks/soak``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import KV_CACHE_DTYPES, MODELS, MODES, REPO_ROOT, SoakConfig
from .report import summary
from .runner import run_mode


def build_parser() -> argparse.ArgumentParser:
    d = SoakConfig()
    p = argparse.ArgumentParser(
        prog="python benchmarks/soak",
        description="Soak a live vllm-hybrid server of a tiny hybrid on 127.0.0.1 with "
        "a bounded, seeded request mix; check it after every phase; exit 1 on any "
        "failed check.",
    )
    p.add_argument("--mode", choices=[*MODES, "both"], default="both")
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype
    )
    p.add_argument("--requests", type=int, default=d.requests, help="requests per mode")
    p.add_argument(
        "--seconds",
        type=float,
        default=d.seconds,
        help="time limit of one mode's traffic (no request starts after it)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--kv-cache-mib", type=float, default=d.kv_cache_mib)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument(
        "--burst", type=int, default=None, help="requests per burst (8 x max-num-seqs)"
    )
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument("--rss-growth-mib", type=float, default=d.rss_growth_mib)
    p.add_argument("--flat-process-mib", type=float, default=d.flat_process_mib)
    p.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".tiny-models")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--compile", action="store_true", help="no --enforce-eager")
    p.add_argument(
        "--request-seeds",
        action="store_true",
        help="give sampled requests a per-request seed (vLLM 0.32 on CPU then "
        "crashes on prompts longer than one prefill step, in both modes)",
    )
    p.add_argument("--json", type=Path, help="also write every report to this file")
    return p


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    if args.requests < 1 or args.seconds <= 0:
        raise SystemExit("soak: --requests must be >= 1 and --seconds > 0")
    return SoakConfig(
        model=args.model,
        modes=tuple(MODES) if args.mode == "both" else (args.mode,),
        kv_cache_dtype=args.kv_cache_dtype,
        requests=args.requests,
        seconds=args.seconds,
        seed=args.seed,
        max_model_len=args.max_model_len,
        kv_cache_mib=args.kv_cache_mib,
        max_num_seqs=args.max_num_seqs,
        concurrency=args.concurrency,
        burst=args.burst if args.burst is not None else 8 * args.max_num_seqs,
        rounds=args.rounds,
        request_timeout=args.request_timeout,
        rss_growth_mib=args.rss_growth_mib,
        flat_process_mib=args.flat_process_mib,
        model_dir=args.model_dir,
        log_dir=args.log_dir,
        compile=args.compile,
        request_seeds=args.request_seeds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    reports = [run_mode(cfg, mode, log) for mode in cfg.modes]
    for report in reports:
        print(summary(report))
        print()
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in reports], indent=1))
    return 0 if all(r.ok for r in reports) else 1
