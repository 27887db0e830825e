"""Command line of the benchmark (``benchmarks/bench_pooled.py``): a table of
options, most of them one :class:`BenchConfig` field each."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from benchmarks.harness import MODELS

from .config import (
    DEFAULT_WORKLOADS,
    MIB,
    MODES,
    REPO_ROOT,
    WORKLOADS,
    BenchConfig,
    quick_config,
)
from .driver import run_driver
from .worker import worker_main


def _csv(choices: Sequence[str] | None) -> Callable[[str], list[str] | tuple]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        # a mode may carry its own KV cache dtype: "overlay:turboquant_k8v4"
        names = [item.partition(":")[0] for item in items]
        bad = [name for name in names if choices is not None and name not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {bad}; choose from {', '.join(choices or ())}"
            )
        return items

    return parse


def _layers(text: str) -> tuple[str, ...]:
    return tuple(layer for layer in text.split(",") if layer)


#: Options that set the ``BenchConfig`` field of the same name (default: the
#: field's): flag, value type, help. Every engine option applies to both modes;
#: what each one does: docs/benchmarks.md, "How bench_pooled measures".
FIELD_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("--seed", int, "seed of all generated prompts"),
    ("--block-size", int, "attention block of every engine but one_long's"),
    ("--mamba-block-size", int, "align-mode state interval, prefix caching"),
    ("--kv-cache-dtype", str, "KV cache dtype of every engine"),
    ("--kv-cache-dtype-skip-layers", _layers, "layers kept at the model dtype"),
    ("--mamba-ssm-cache-dtype", str, "SSM state dtype: float32, bfloat16, auto"),
)
#: Other options: flag, value type (or argparse action), default, help.
OTHER_OPTIONS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--models", _csv(None), list(MODELS), "tiny model kinds"),
    (
        "--workloads",
        _csv(WORKLOADS),
        list(DEFAULT_WORKLOADS),
        f"of {','.join(WORKLOADS)}",
    ),
    ("--modes", _csv(MODES), list(MODES), "the first is the reference"),
    ("--json", str, None, "also write all results to this JSON file"),
    ("--model-dir", Path, REPO_ROOT / ".tiny-models", "tiny models built/reused"),
    ("--log-dir", str, None, "worker logs (default: a new temp dir)"),
    ("--jobs", int, 1, "workers at once (>1 skews wall times)"),
    ("--one-long-block-size", int, BenchConfig.one_long_block_size, "(0: default)"),
    (
        "--admission-block-size",
        int,
        BenchConfig.admission_block_size,
        "admission engine's block (0: --block-size)",
    ),
    ("--budget-mib", float, BenchConfig.budget_bytes / MIB, "main engine budget"),
    ("--gpu", "store_true", None, "CUDA graphs, 16-token blocks, model SSM dtype"),
    ("--compile", "store_true", None, "torch.compile (~35 s per engine start)"),
    ("--quick", "store_true", None, "shrunken workloads (numbers not comparable)"),
)
STATE_DTYPES = ("float32", "bfloat16", "auto")


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Upstream vs vllm-hybrid overlay KV cache benchmark (CPU or, "
        "with --gpu, CUDA); docs/benchmarks.md says what each option does.",
    )
    defaults = {f.name: f.default for f in fields(BenchConfig)}
    for flag, kind, text in FIELD_OPTIONS:
        default = defaults[_dest(flag)]
        extra = {"choices": STATE_DTYPES} if flag == "--mamba-ssm-cache-dtype" else {}
        text = f"{text} (default: {default})"
        parser.add_argument(flag, type=kind, default=default, help=text, **extra)
    for flag, kind, default, text in OTHER_OPTIONS:
        if kind == "store_true":
            parser.add_argument(flag, action=kind, help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)
    # a worker process: its job and where its report goes (driver.py)
    parser.add_argument(
        "--worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS
    )
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.gpu:  # CUDA graphs, 16-token blocks, the model's SSM dtype
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device; none is visible here")
        args.compile, args.mamba_ssm_cache_dtype = True, "auto"
        args.block_size, args.one_long_block_size = args.block_size or 16, 16
    cfg = BenchConfig(
        **{_dest(flag): getattr(args, _dest(flag)) for flag, _, _ in FIELD_OPTIONS},
        enforce_eager=not args.compile,
        one_long_block_size=args.one_long_block_size or None,
        admission_block_size=args.admission_block_size or args.block_size,
        budget_bytes=int(args.budget_mib * MIB),
        modes=tuple(args.modes),
    )
    return quick_config(cfg) if args.quick else cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    return run_driver(args, config_from_args(args))
