"""Longest single prompt a fixed KV budget serves: ``auto`` vs TurboQuant.

bench_pooled's one_long search unchanged (``one_long_part``) on engines that
differ only in ``--kv-cache-dtype`` (settings and figures:
docs/turboquant-backend.md, "Capacity"). Attention bytes per token fall
from 4096 (bf16 K/V, head_dim 256, 2 KV heads, 2 attention layers) to 1552
with k8v4 (388-byte slots), 2.64x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# bench_pooled's library: the repository root takes this folder's place on
# sys.path when the script runs.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import benchmarks.pooled as bp  # noqa: E402
from benchmarks.harness import tiny_model  # noqa: E402
from benchmarks.pooled.worker import engine_specs  # noqa: E402


def longest_prompt(kind: str, path: str, dtype: str, prefix: bool, cfg) -> dict:
    """bench_pooled's one_long result for one cache dtype."""
    cfg = replace(cfg, kv_cache_dtype=dtype)
    spec = engine_specs(path, kind, cfg)["one_long_pc_off"]
    spec = replace(spec, prefix_caching=prefix)
    report = bp.WorkerReport(model=kind, mode=dtype)
    result = bp.one_long_part(report, f"one_long_{dtype}", spec, cfg)
    metrics = result["metrics"]
    engine = report.engines.get(f"one_long_{dtype}", {})
    return {
        "longest_prompt": metrics["longest_prompt"],
        "reported_capacity_tokens": metrics.get("reported_capacity_tokens"),
        "max_model_len": metrics.get("max_model_len"),
        "tries": metrics["tries"],
        "errors": report.errors,
        "start_error": engine.get("start_error"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3_5")
    parser.add_argument("--dtypes", default="auto,turboquant_k8v4")
    parser.add_argument("--budget-mib", type=float, default=5.0)
    parser.add_argument("--prefix-caching", default="off,on")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = replace(bp.BenchConfig(), one_long_budget_bytes=int(args.budget_mib * bp.MIB))
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny_model(args.model, Path(tmp)))
        for pc in args.prefix_caching.split(","):
            for dtype in args.dtypes.split(","):
                r = longest_prompt(args.model, path, dtype, pc == "on", cfg)
                report[f"pc_{pc}/{dtype}"] = r
                print(f"[tq-capacity] prefix caching {pc}, {dtype}: {r}", flush=True)
    print(f"| {args.model}, {args.budget_mib:g} MiB | longest prompt | ratio |")
    print("| --- | ---: | ---: |")
    for pc in args.prefix_caching.split(","):
        base = report.get(f"pc_{pc}/auto", {}).get("longest_prompt") or 0
        for dtype in args.dtypes.split(","):
            n = report[f"pc_{pc}/{dtype}"]["longest_prompt"]
            ratio = f"{n / base:.2f}x" if base else "-"
            print(f"| prefix caching {pc}, {dtype} | {n} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
