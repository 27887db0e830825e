"""The same_tokens workload: fixed prompts whose greedy tokens both modes
must produce alike, and the comparison of their token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hybrid.tools.inproc import first_difference
from vllm_hybrid.tools.simulate.sources import SimRequest
from vllm_hybrid.tools.workloads import same_tokens_prompts

from .config import MIB, BenchConfig
from .engine import Batch, Engine, drive
from .workloads import check_finished

#: KV budget of the forced-preemption run per model kind: room for about
#: three of the 760-token prompts in upstream's plan (6 blocks of 1 MiB each
#: for qwen3_5, 5 blocks of 0.75 MiB for qwen3_next), but not for their growth.
PREEMPT_BUDGET_MIB: dict[str, float] = {"qwen3_5": 20.0, "qwen3_next": 12.0}
DEFAULT_PREEMPT_BUDGET_MIB = 16.0


def preempt_budget_bytes(cfg: BenchConfig, kind: str) -> int:
    """The forced-preemption budget: the CLI value, else the kind's default."""
    if cfg.preempt_budget_bytes is not None:
        return cfg.preempt_budget_bytes
    return int(PREEMPT_BUDGET_MIB.get(kind, DEFAULT_PREEMPT_BUDGET_MIB) * MIB)


def _same_tokens_pass(
    engine: Engine, cfg: BenchConfig, prompts: Sequence[list[int]]
) -> dict[str, Any]:
    """One batch of the fixed prompts; token ids per prompt."""
    keys = [f"fixed-{i}" for i in range(len(prompts))]
    batch = Batch(
        SimRequest(key, p, cfg.same_tokens_output, 0.0, logprobs=2)
        for key, p in zip(keys, prompts, strict=True)
    )
    result = drive(engine, batch, cfg)
    check_finished(result, "same_tokens")
    return {
        "tokens": [batch.replies[key] for key in keys],
        "top2_gaps": [result.top2_gaps(key) for key in keys],
        "preemptions": result.preemptions,
        "cached_tokens": result.cached_tokens(),
        "wall_s": result.wall_s,
    }


def run_same_tokens(engine: Engine, cfg: BenchConfig, config: str) -> dict[str, Any]:
    """One pass set of an engine: ``pc_on`` runs the prompts cold, then again
    (hits); ``alone`` runs each prompt by itself, the batch-dependence control
    of ``pc_off`` (docs/benchmarks.md, same_tokens); any other ``config`` is
    one pass of the prompts."""
    prompts = same_tokens_prompts(cfg.seed, engine.vocab())
    if config == "pc_on":
        engine.reset_prefix_cache()
        return {
            "pc_on": _same_tokens_pass(engine, cfg, prompts),
            "pc_on_repeat": _same_tokens_pass(engine, cfg, prompts),
        }
    if config != "alone":
        return {config: _same_tokens_pass(engine, cfg, prompts)}
    passes = [_same_tokens_pass(engine, cfg, [prompt]) for prompt in prompts]
    return {
        "alone": {
            "tokens": [p["tokens"][0] for p in passes],
            "top2_gaps": [p["top2_gaps"][0] for p in passes],
            "preemptions": sum(p["preemptions"] for p in passes),
            "cached_tokens": sum(p["cached_tokens"] for p in passes),
            "wall_s": sum(p["wall_s"] for p in passes),
        }
    }


def tokens_verdict(upstream: Sequence[list[int]], overlay: Sequence[list[int]]) -> str:
    """ "k/n prompts equal", comparing token ids prompt by prompt."""
    n = max(len(upstream), len(overlay))
    same = sum(a == b for a, b in zip(upstream, overlay, strict=False))
    return f"{same}/{n} prompts equal"


def first_difference_gap(run: dict[str, Any], other: Sequence[list[int]]) -> str:
    """Largest top-2 log-probability gap of this run at the first token where
    a prompt differs from ``other`` (small: a near tie, rounding decides)."""
    worst: float | None = None
    for mine, theirs, gaps in zip(
        run["tokens"], other, run.get("top2_gaps", []), strict=False
    ):
        at = first_difference(mine, theirs)
        if at is None:
            continue
        gap = gaps[at] if at < len(gaps) else None
        if gap is not None:
            worst = gap if worst is None else max(worst, gap)
    return "-" if worst is None else f"{worst:.4f}"


def same_as_pc_off(configs: dict[str, Any], name: str) -> str | None:
    """Verdict of configuration ``name`` against ``pc_off`` of the same mode."""
    base, other = configs.get("pc_off"), configs.get(name)
    if not base or not other:
        return None
    return tokens_verdict(base["tokens"], other["tokens"])
