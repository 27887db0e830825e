"""Command line of the benchmark (``benchmarks/bench_pooled.py``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import (
    ALL_MODES,
    DEFAULT_MODELS,
    DEFAULT_WORKLOADS,
    MIB,
    MODES,
    REPO_ROOT,
    WORKLOADS,
    BenchConfig,
    quick_config,
)
from .driver import run_driver
from .worker import run_worker


def _csv(choices: Sequence[str] | None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if choices is not None:
            bad = [item for item in items if item not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {bad}; choose from {', '.join(choices)}"
                )
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Upstream vs vllm-hybrid overlay KV cache benchmark (CPU or, "
        "with --gpu, CUDA).",
    )
    parser.add_argument(
        "--models",
        type=_csv(None),
        default=list(DEFAULT_MODELS),
        help="tiny model kinds, comma separated (default: qwen3_5,qwen3_next)",
    )
    parser.add_argument(
        "--workloads",
        type=_csv(WORKLOADS),
        default=list(DEFAULT_WORKLOADS),
        help="comma separated subset of "
        + ",".join(WORKLOADS)
        + " (default: "
        + ",".join(DEFAULT_WORKLOADS)
        + ")",
    )
    parser.add_argument(
        "--chat-server-conversations",
        type=int,
        default=BenchConfig.chat_server_conversations,
        help="chat_server: conversations (default: 32)",
    )
    parser.add_argument(
        "--chat-server-turns",
        type=int,
        default=BenchConfig.chat_server_turns,
        help="chat_server: turns per conversation (default: 6)",
    )
    parser.add_argument(
        "--chat-server-concurrency",
        type=int,
        default=BenchConfig.chat_server_concurrency,
        help="chat_server: turns in flight at once (default: 8)",
    )
    parser.add_argument("--json", help="also write all results to this JSON file")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=REPO_ROOT / ".tiny-models",
        help="where tiny models are built/reused (default: .tiny-models)",
    )
    parser.add_argument("--log-dir", help="worker logs (default: a new temp dir)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="workers run at once; >1 overlaps runs and skews wall times",
    )
    parser.add_argument("--seed", type=int, default=BenchConfig.seed)
    parser.add_argument(
        "--one-long-block-size",
        type=int,
        default=BenchConfig.one_long_block_size,
        help="attention --block-size of the one_long engines, both modes "
        "(default: 32; 0 keeps the platform default)",
    )
    parser.add_argument(
        "--mamba-block-size",
        type=int,
        default=None,
        help="state checkpoint interval (align mode) of the prefix-caching "
        "engines other than one_long's, both modes (default: the attention block)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="attention --block-size of every engine but one_long's, both "
        "modes (default: the platform's, 128 on CPU and 16 on CUDA)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=BenchConfig.kv_cache_dtype,
        help="--kv-cache-dtype of every engine, both modes (e.g. "
        "turboquant_k8v4; default: auto)",
    )
    parser.add_argument(
        "--kv-cache-dtype-skip-layers",
        default="",
        help="--kv-cache-dtype-skip-layers of every engine, both modes, comma "
        "separated (layers kept at the model's dtype; default: none)",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="what a CUDA user runs: CUDA graphs (no --enforce-eager), 16-token "
        "blocks everywhere, the model's SSM state dtype; refuses to run "
        "without a CUDA device",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=BenchConfig.budget_bytes / MIB,
        help="KV budget of the many_short, multi_turn and same_tokens engines "
        "(default: 48)",
    )
    parser.add_argument(
        "--no-couple-prefix-caches",
        action="store_true",
        help="pooled mode without coordinated eviction across its pools "
        "(each pool evicts by its own LRU), to measure what coupling buys",
    )
    parser.add_argument(
        "--no-retain-turn-ends",
        action="store_true",
        help="the overlay without turn-end checkpoints (hybrid_kv."
        "retain_turn_ends false), to measure what they buy",
    )
    parser.add_argument(
        "--preempt-budget-mib",
        type=float,
        default=None,
        help="KV budget of the same_tokens forced-preemption run (default: 20 "
        "for qwen3_5, 12 for qwen3_next, 16 otherwise)",
    )
    parser.add_argument(
        "--same-tokens-threads",
        type=int,
        default=BenchConfig.same_tokens_threads,
        help="OpenMP threads of the same_tokens workers, both modes (default: 1, "
        "which makes CPU attention independent of batch composition; 0 runs "
        "same_tokens in the main workers with the platform's threads)",
    )
    parser.add_argument(
        "--same-tokens-cached-only",
        action="store_true",
        help="same_tokens runs only its prefix-caching passes (pc_on, "
        "pc_on_repeat), not pc_off, alone and the forced preemption",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("float32", "bfloat16", "auto"),
        default=BenchConfig.mamba_ssm_cache_dtype,
        help="SSM state dtype of every engine (default: float32, what vLLM "
        "forces on AVX512-BF16 CPUs, so figures match on any host; auto keeps "
        "this host's choice)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="use torch.compile (default: eager; compiling adds ~35 s per engine)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="shrunken workloads to check the harness (numbers not comparable)",
    )
    parser.add_argument(
        "--modes",
        type=_csv(ALL_MODES),
        default=list(MODES),
        help="engines to compare, the first one the reference of every ratio: "
        + ",".join(ALL_MODES)
        + " (default: "
        + ",".join(MODES)
        + "; upstream_best is upstream with --prefix-match-unit and "
        "--prefix-cache-retention-interval, single the overlay's single pool)",
    )
    parser.add_argument(
        "--prefix-match-unit",
        type=int,
        help="upstream_best: vLLM's --prefix-match-unit (e.g. the attention block)",
    )
    parser.add_argument(
        "--prefix-cache-retention-interval",
        type=lambda text: None if text == "none" else int(text),
        default=BenchConfig.prefix_cache_retention_interval,
        help="upstream_best: vLLM's --prefix-cache-retention-interval ('none': "
        "dense retention; default 0)",
    )
    parser.add_argument(
        "--prefill-checkpoint-interval",
        type=int,
        help="pooled mode's hybrid_kv.prefill_checkpoint_interval (0: off; "
        "default: its rule)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="overlay", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    return parser


def apply_gpu_preset(args: argparse.Namespace) -> None:
    """``--gpu``: CUDA graphs, 16-token blocks, the model's SSM dtype."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; none is visible here")
    args.compile = True
    args.block_size = args.block_size or 16
    args.one_long_block_size = 16
    args.mamba_ssm_cache_dtype = "auto"


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.config_json:
        return BenchConfig(**json.loads(args.config_json))
    if args.gpu:
        apply_gpu_preset(args)
    cores = os.cpu_count() or 1
    if not 0 <= args.same_tokens_threads <= cores:
        raise SystemExit(
            f"--same-tokens-threads {args.same_tokens_threads}: use 0 (the "
            f"platform's threads) or 1..{cores} (this machine's cores)"
        )
    cfg = BenchConfig(
        seed=args.seed,
        preempt_budget_bytes=(
            None
            if args.preempt_budget_mib is None
            else int(args.preempt_budget_mib * MIB)
        ),
        enforce_eager=not args.compile,
        one_long_block_size=args.one_long_block_size or None,
        mamba_block_size=args.mamba_block_size,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_dtype_skip_layers=tuple(
            layer for layer in args.kv_cache_dtype_skip_layers.split(",") if layer
        ),
        budget_bytes=int(args.budget_mib * MIB),
        couple_prefix_caches=not args.no_couple_prefix_caches,
        retain_turn_ends=not args.no_retain_turn_ends,
        same_tokens_threads=args.same_tokens_threads,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        same_tokens_uncached=not args.same_tokens_cached_only,
        chat_server_conversations=args.chat_server_conversations,
        chat_server_turns=args.chat_server_turns,
        chat_server_concurrency=args.chat_server_concurrency,
        modes=tuple(args.modes),
        prefix_match_unit=args.prefix_match_unit,
        prefix_cache_retention_interval=args.prefix_cache_retention_interval,
        prefill_checkpoint_interval=args.prefill_checkpoint_interval,
    )
    return quick_config(cfg) if args.quick else cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    if args.worker:
        if len(args.models) != 1:
            raise SystemExit("--worker runs exactly one model")
        report = run_worker(
            args.models[0], args.model_dir, args.workloads, cfg, args.mode
        )
        return 1 if report.errors else 0
    return run_driver(args, cfg)
