"""TurboQuant KV cache quality against ``auto`` on the tiny hybrid models.

Teacher forcing, one in-process engine per cache dtype: top-1 agreement with
``auto`` and mean KL(auto || preset) over the same positions (method and
figures: docs/turboquant-backend.md, "Quality").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The repository root takes this folder's place on sys.path when the script
# runs, so the benchmarks import as the package ``benchmarks``.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import MIB, markdown_table, tiny_model  # noqa: E402
from testing.inproc import llm_vocab, open_llm  # noqa: E402
from vllm_hybrid.ops.tq_dtypes import TQ_CACHE_DTYPES  # noqa: E402
from vllm_hybrid.tools.workloads import random_tokens  # noqa: E402


def prompts_for(vocab: list[int], positions: int, length: int, seed: int):
    """Random prompts whose scored positions (all but the first) sum to
    ``positions``; the last prompt is shortened to hit the count."""
    rng = random.Random(f"tq_quality/{seed}")
    prompts, left = [], positions
    while left > 0:
        n = min(length, left + 1)
        prompts.append(random_tokens(rng, vocab, n))
        left -= n - 1
    return prompts


def distributions(llm: Any, prompts: list[list[int]], vocab_size: int):
    """Per scored position: a list of ``vocab_size`` log-probabilities."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab_size)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    rows = []
    for out in outs:
        for entry in out.prompt_logprobs[1:]:
            row = [-math.inf] * vocab_size
            for token, logprob in entry.items():
                if token < vocab_size:
                    row[token] = logprob.logprob
            rows.append(row)
    return rows


def compare(reference: list[list[float]], other: list[list[float]]) -> dict:
    """Top-1 agreement and mean KL(reference || other) over positions."""
    import torch

    ref = torch.tensor(reference, dtype=torch.float64)
    oth = torch.tensor(other, dtype=torch.float64)
    agree = (ref.argmax(-1) == oth.argmax(-1)).double().mean().item()
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - oth), torch.zeros_like(p))
    kl = terms.sum(-1)
    return {
        "positions": ref.shape[0],
        "top1_agreement": agree,
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
    }


def run_model(kind: str, root: Path, args: argparse.Namespace) -> dict:
    path = str(tiny_model(kind, root))
    results: dict[str, Any] = {}
    reference = None
    for dtype in ("auto", *args.presets):
        kwargs = {
            "model": path,
            "kv_cache_memory_bytes": args.budget_mib * MIB,
            "kv_cache_dtype": dtype,
            "enable_prefix_caching": False,
            "max_num_seqs": 16,
            "max_model_len": args.prompt_len + 16,
            "enforce_eager": True,
            "seed": 0,
            "mamba_ssm_cache_dtype": "float32",
            "max_logprobs": args.vocab,
        }
        start = time.perf_counter()
        with open_llm(kwargs) as llm:
            size = llm.llm_engine.vllm_config.model_config.get_vocab_size()
            prompts = prompts_for(llm_vocab(llm), args.positions, args.prompt_len, 0)
            rows = distributions(llm, prompts, size)
        wall = time.perf_counter() - start
        if dtype == "auto":
            reference = rows
            results[dtype] = {"positions": len(rows), "wall_s": wall}
        else:
            results[dtype] = compare(reference, rows) | {"wall_s": wall}
        print(f"[tq-quality] {kind} {dtype}: {results[dtype]}", flush=True)
    return results


def format_table(report: dict[str, dict]) -> str:
    """The table of docs/turboquant-backend.md, "Quality"."""
    rows = []
    for kind, results in report.items():
        for dtype in [d for d in TQ_CACHE_DTYPES if d in results]:
            r = results[dtype]
            kl = (f"{r['mean_kl']:.5f}", f"{r['max_kl']:.4f}")
            agree = f"{100 * r['top1_agreement']:.1f}%"
            rows.append((kind, dtype, r["positions"], agree, *kl))
    head = ("model", "preset", "positions", "top-1 agreement", "mean KL (nats)")
    return markdown_table((*head, "max KL"), rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3_5,qwen3_next")
    parser.add_argument("--presets", default=",".join(TQ_CACHE_DTYPES))
    parser.add_argument("--positions", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=501)
    parser.add_argument("--budget-mib", type=int, default=48)
    parser.add_argument(
        "--vocab", type=int, default=2048, help="max_logprobs (>= vocab size)"
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            report[kind] = run_model(kind, Path(tmp), args)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
