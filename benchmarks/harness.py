"""What the benchmarks' command lines share: the tiny models they run, the
KV cache dtypes they compare, the ``vllm serve`` options of the soak's and
the serving benchmark's servers, and how their tables show ratios. The
loopback server itself is :mod:`testing.loopback` (the server tests
and the demo use it too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MIB = 2**20
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Where the command lines build or reuse the tiny models.
TINY_MODELS = REPO_ROOT / ".tiny-models"
MODELS = ("qwen3_5", "qwen3_next")
KV_CACHE_DTYPES = ("auto", "turboquant_k8v4")


def server_args(cfg: Any, dtype: str) -> list[str]:
    """``vllm serve`` options of a soak or serve config's servers: float32 SSM
    state (a budget splits the same on every host), eager unless ``compile``."""
    args = [
        f"--kv-cache-memory-bytes={int(cfg.kv_cache_mib * MIB)}",
        f"--kv-cache-dtype={dtype}",
        f"--max-model-len={cfg.max_model_len}",
        f"--max-num-seqs={cfg.max_num_seqs}",
        "--mamba-ssm-cache-dtype=float32",
        f"--seed={cfg.seed}",
        "--disable-uvicorn-access-log",
    ]
    return args if cfg.compile else [*args, "--enforce-eager"]


def tiny_model(kind: str, model_dir: Path = TINY_MODELS) -> Path:
    """The tiny model ``kind`` under ``model_dir``, built on first use."""
    from vllm_hybrid.tools.tiny_models import build_tiny_model

    return Path(build_tiny_model(model_dir / kind, kind))


def ratio(num: Any, den: Any) -> float | None:
    """``num / den`` for numbers; None when it has no meaning."""
    if isinstance(num, bool) or isinstance(den, bool):
        return None
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)):
        return None
    if den == 0 or math.isnan(den) or math.isnan(num):
        return None
    return num / den


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table, as the benchmarks print their results and
    benchmarks/results/ keeps them."""
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)
