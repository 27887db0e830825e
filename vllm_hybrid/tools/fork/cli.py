"""``vllm-hybrid fork OUT_DIR [--sdist PATH] [--wheel]``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_hybrid import SUPPORTED_VLLM_VERSION


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-hybrid fork",
        description=(
            f"Write vLLM {SUPPORTED_VLLM_VERSION} with this overlay's fixes in place "
            "into OUT_DIR: a git repository whose first commit is vLLM's published "
            "tree, then one commit per fix, and the series as patches in "
            "OUT_DIR/patches."
        ),
    )
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="a new directory")
    p.add_argument(
        "--sdist",
        type=Path,
        help=f"vLLM {SUPPORTED_VLLM_VERSION}'s source archive (default: fetched "
        "from the package index once, then cached)",
    )
    p.add_argument(
        "--wheel",
        action="store_true",
        help="also write OUT_DIR/dist/*.whl: the installed vLLM wheel with the "
        "fork's Python files in place (no compiler needed)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from vllm_hybrid.tools.fork.code import ForkError
    from vllm_hybrid.tools.fork.generate import materialize

    start = time.monotonic()
    try:
        result = materialize(args.out_dir, args.sdist, wheel=args.wheel)
    except (ForkError, FileExistsError, FileNotFoundError) as exc:
        print(f"vllm-hybrid fork: {exc}", file=sys.stderr)
        return 2
    series = result.series
    print(
        f"{series.root}: vLLM {SUPPORTED_VLLM_VERSION} and {len(series.commits)} "
        f"commits, {len(series.patches)} patches in {series.root / 'patches'} "
        f"({time.monotonic() - start:.0f} s)"
    )
    if result.wheel is not None:
        print(f"wheel: {result.wheel}")
    return 0
