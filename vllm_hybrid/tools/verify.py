"""``vllm-hybrid verify``: check an install on this machine's device.

Builds a tiny random-weight hybrid (``qwen3_5`` unless ``--kind`` says
otherwise; offline, seconds), then runs
it in three engines, each in its own process: pooled mode, the overlay's
single shared pool, and upstream vLLM (``VLLM_HYBRID_KV=0``). Each engine
generates greedily for prompts that share a prefix, twice (the second pass
reads what the first one cached). On CUDA the engines run what CUDA users run:
CUDA graphs and 16-token attention blocks; on CPU, eager and 32-token blocks.

Checks, printed one per line with PASS/FAIL, exit code 0 only if all pass:

* the overlay is active in the overlay's engines and off in upstream's;
* pooled mode planned a pooled arena whose pools and layer views start on
  ``VIEW_ALIGNMENT_BYTES``;
* both overlay modes produce upstream's greedy tokens (a difference may only
  start where upstream's top two tokens were within :data:`NEAR_TIE` in
  log-probability: bf16 rounding, not a fault), cached pass included.

It also prints each engine's token capacity and pooled/upstream ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.greedy import NEAR_TIE, first_difference, top2_gaps

if TYPE_CHECKING:
    from vllm import LLM

RESULT_PREFIX = "VERIFY_RESULT "
#: Mode -> (value of VLLM_HYBRID_KV, extra engine arguments).
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "pooled": ("1", {}),
    "single_pool": ("1", {"additional_config": {"hybrid_kv": {"pooled": False}}}),
    "upstream": ("0", {}),
}
SHARED_PREFIX = list(range(7, 7 + 90))
PROMPTS = [
    SHARED_PREFIX + [3, 5, 8],
    SHARED_PREFIX + [4, 6, 9, 11],
    list(range(200, 260)),
]
OUTPUT_TOKENS = 12


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_kwargs(
    model_dir: Path, kv_cache_dtype: str, tensor_parallel_size: int = 1
) -> dict[str, Any]:
    """One engine's arguments, the same in every mode."""
    cuda = _on_cuda()
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "model": str(model_dir),
        "kv_cache_memory_bytes": 64 * 2**20,
        "max_model_len": 1024,
        "enable_prefix_caching": True,
        "block_size": 16 if cuda else 32,
        "enforce_eager": not cuda,
        "kv_cache_dtype": kv_cache_dtype,
        "mamba_ssm_cache_dtype": "float32",
        "seed": 0,
    }


# -- one engine (worker process) ------------------------------------------


def _greedy(llm: LLM) -> dict[str, list]:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens, gaps = [], []
    for out in outs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        gaps.append(top2_gaps(completion))
    return {"tokens": tokens, "gaps": gaps}


def _plan_facts(llm: LLM) -> dict[str, Any]:
    from vllm_hybrid.v1.core.pooled.spec import (
        VIEW_ALIGNMENT_BYTES,
        PooledKVCacheConfig,
    )

    # The worker runs its engine in this process (multiprocessing off), so
    # the engine's client is in-process and holds the core itself.
    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    cache = llm.llm_engine.vllm_config.cache_config
    facts: dict[str, Any] = {
        "pooled": isinstance(config, PooledKVCacheConfig),
        "token_capacity": cache.kv_cache_size_tokens,
    }
    if facts["pooled"]:
        facts["misaligned"] = [
            f"{t.layers[0]}: {name} {getattr(t, name)}"
            for t in config.kv_cache_tensors
            for name in ("offset", "layer_stride", "block_stride")
            if getattr(t, name) % VIEW_ALIGNMENT_BYTES
        ]
        facts["pools"] = config.describe_pools()
    return facts


def run_worker(mode: str, args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_hybrid import plugin

    kwargs = engine_kwargs(
        args.model_dir, args.kv_cache_dtype, args.tensor_parallel_size
    )
    llm = LLM(**kwargs | MODES[mode][1])
    state = plugin.state()
    result = {
        "mode": mode,
        "overlay_active": bool(state is not None and state.active),
        "first": _greedy(llm),
        "again": _greedy(llm),
        **_plan_facts(llm),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# -- the driver -----------------------------------------------------------


def _run_mode(mode: str, model_dir: Path, args: argparse.Namespace) -> dict | str:
    """The worker's result, or the tail of its output when it failed."""
    env = dict(os.environ, VLLM_HYBRID_KV=MODES[mode][0])
    command = [sys.executable, "-m", "vllm_hybrid.tools.verify", "--worker", mode]
    command += ["--model-dir", str(model_dir), "--kv-cache-dtype", args.kv_cache_dtype]
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return f"exit code {proc.returncode}:\n    " + "\n    ".join(tail)


def token_differences(reference: dict, tokens: list[list[int]]) -> list[str]:
    """Differences that do not start at one of the reference's near-ties."""
    found = []
    for i, (ref, ids) in enumerate(zip(reference["tokens"], tokens, strict=True)):
        at = first_difference(ref, ids)
        if at is None:
            continue
        gaps = reference["gaps"][i]
        gap = gaps[at] if at < len(gaps) else None
        if gap is None or gap > NEAR_TIE:
            found.append(f"prompt {i} from token {at} (upstream's top-2 gap {gap})")
    return found


def evaluate(results: dict[str, dict]) -> list[Check]:
    """The checks of a complete set of worker results."""
    checks = []
    for mode, result in results.items():
        want = mode != "upstream"
        checks.append(
            Check(
                f"overlay {'active' if want else 'off'} in the {mode} engine",
                result["overlay_active"] == want,
                f"overlay_active={result['overlay_active']}",
            )
        )
    pooled = results["pooled"]
    checks.append(
        Check(
            "pooled arena planned and aligned",
            pooled["pooled"] and not pooled.get("misaligned"),
            pooled.get("pools", "no pooled plan")
            + (
                f"; misaligned: {pooled['misaligned']}"
                if pooled.get("misaligned")
                else ""
            ),
        )
    )
    upstream = results["upstream"]
    for mode in ("pooled", "single_pool"):
        for run in ("first", "again"):
            diffs = token_differences(upstream["first"], results[mode][run]["tokens"])
            checks.append(
                Check(
                    f"{mode} tokens equal upstream's ({run} pass)",
                    not diffs,
                    "; ".join(diffs) or f"{len(PROMPTS)} prompts x {OUTPUT_TOKENS}",
                )
            )
    return checks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-hybrid verify", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kind", default="qwen3_5", choices=("qwen3_5", "qwen3_next"))
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per engine"
    )
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args)

    from vllm_hybrid.tools.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="vllm-hybrid-verify-") as tmp:
        model_dir = args.model_dir or Path(tmp) / args.kind
        build_tiny_model(model_dir, args.kind)
        device = "cuda (CUDA graphs, 16-token blocks)" if _on_cuda() else "cpu (eager)"
        print(
            f"vllm-hybrid verify: tiny {args.kind}, {device}, KV "
            f"{args.kv_cache_dtype}, TP={args.tensor_parallel_size}"
        )
        results: dict[str, dict] = {}
        failed: list[Check] = []
        for mode in MODES:
            outcome = _run_mode(mode, model_dir, args)
            if isinstance(outcome, str):
                failed.append(Check(f"{mode} engine runs", False, outcome))
            else:
                results[mode] = outcome
    checks = failed or evaluate(results)
    for check in checks:
        print(check.line())
    if not failed:
        capacity = {m: r["token_capacity"] for m, r in results.items()}
        ratio = capacity["pooled"] / capacity["upstream"]
        print(
            "token capacity: "
            + ", ".join(f"{m} {c:,}" for m, c in capacity.items())
            + f" (pooled / upstream {ratio:.2f}x)"
        )
    ok = all(check.ok for check in checks)
    print("verify: " + ("all checks passed" if ok else "FAILED"))
    if args.json:
        report = {"ok": ok, "checks": [c.__dict__ for c in checks]}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
