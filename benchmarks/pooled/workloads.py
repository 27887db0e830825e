"""The many_short, multi_turn and one_long workloads on an open engine
(same_tokens is in :mod:`.same_tokens`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from vllm_hybrid.tools import workloads as wl
from vllm_hybrid.tools.plan.geometry import KVGeometry, kv_geometry
from vllm_hybrid.tools.simulate.sources import (
    ManyShortShape,
    ManyShortWorkload,
    MultiTurnShape,
    MultiTurnWorkload,
    SimRequest,
)

from .config import BenchConfig
from .engine import Batch, Drive, Engine, drive
from .pools import KVSample, coupled_evictions


def _peak_samples(samples: Sequence[KVSample]) -> dict[str, Any]:
    """Peak running, and needed/reserved at the first step of that peak."""
    if not samples:
        return {}
    peak = max(samples, key=lambda s: (s.running, -s.step))
    ratios = [s.needed_over_reserved for s in samples if s.running]
    ratios = [r for r in ratios if r is not None]
    return {
        "peak_running": peak.running,
        "peak_step": peak.step,
        "needed_bytes_at_peak": round(peak.needed_bytes),
        "reserved_bytes_at_peak": peak.reserved_bytes,
        "needed_over_reserved_at_peak": peak.needed_over_reserved,
        "max_needed_over_reserved": max(ratios) if ratios else None,
        "mean_needed_over_reserved": sum(ratios) / len(ratios) if ratios else None,
        "max_reserved_bytes": max(s.reserved_bytes for s in samples),
    }


def _per(amount: float, seconds: float) -> float | None:
    """A rate, or None for an empty interval."""
    return amount / seconds if seconds > 0 else None


def _totals(results: Sequence[Drive]) -> dict[str, Any]:
    """Steps, preemptions, decoded tokens and their rates over drives."""
    out_tokens = sum(r.output_tokens() for r in results)
    wall, cpu = sum(r.wall_s for r in results), sum(r.cpu_s for r in results)
    return {
        "preemptions": sum(r.preemptions for r in results),
        "steps": sum(r.steps for r in results),
        "output_tokens": out_tokens,
        "output_tok_per_s": _per(out_tokens, wall),
        "cpu_s": cpu,
        "output_tok_per_cpu_s": _per(out_tokens, cpu),
    }


def _shape(cls: type, cfg: BenchConfig, workload: str) -> Any:
    """The simulator's shape ``cls`` of a workload from ``cfg``'s
    ``<workload>_<field>`` settings and its seed."""
    names = [f.name for f in fields(cls) if f.name != "seed"]
    return cls(**{n: getattr(cfg, f"{workload}_{n}") for n in names}, seed=cfg.seed)


def check_finished(result: Drive, workload: str) -> None:
    """Raise unless every request of the drive finished."""
    if result.outcome != "finished":
        raise RuntimeError(
            f"{workload}: engine drive ended {result.outcome} after "
            f"{result.steps} steps"
        )


def run_many_short(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """The simulator's many_short prompts, all at once, under the main
    engine's budget."""
    geometry = kv_geometry(engine.scheduler.kv_cache_config)
    shape = _shape(ManyShortShape, cfg, "many_short")
    workload = ManyShortWorkload(shape, engine.vocab())
    result = drive(engine, workload, cfg, geometry=geometry)
    check_finished(result, "many_short")
    metrics = {
        **_peak_samples(result.samples),
        **_totals([result]),
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "attn_bytes_per_token": geometry.attn_bytes_per_token,
        "state_bytes_per_request": geometry.state_bytes_per_request,
    }
    details = {
        "running_per_step": [s.running for s in result.samples],
        "needed_over_reserved_per_step": [
            s.needed_over_reserved for s in result.samples
        ],
    }
    return {"metrics": metrics, "details": details, "wall_s": result.wall_s}


def _state_counts(engine: Engine) -> Callable[[], dict[str, Any]]:
    """What a workload does to align-mode states, counted from this call on
    by the simulator's code, so ``vllm-hybrid simulate`` counts alike: state
    copies and scheduled tokens (its step observer), checkpoints entered into
    the prefix cache (its probe), and pooled mode's prefill chunks cut at a
    checkpoint (the scheduler's count). Nothing without prefix caching."""
    checkpoints = engine.count_checkpoints()
    if checkpoints is None:
        return dict
    steps, scheduler = engine.steps().observer, engine.scheduler
    before = replace(steps.total)
    cached_before = checkpoints.checkpoints
    cuts_before = getattr(scheduler, "prefill_checkpoint_cuts", None)

    def since() -> dict[str, Any]:
        now = steps.total
        cuts = getattr(scheduler, "prefill_checkpoint_cuts", None)
        prefill = now.prefill_tokens - before.prefill_tokens
        return {
            "state_copies": now.copies_moved - before.copies_moved,
            "checkpoints_cached": checkpoints.checkpoints - cached_before,
            "tokens_scheduled": prefill + now.decode_tokens - before.decode_tokens,
            "prefill_tokens_computed": prefill,
            "prefill_checkpoint_cuts": None if cuts is None else cuts - cuts_before,
        }

    return since


def run_multi_turn(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """Conversations sharing a system prefix, run turn by turn: the
    simulator's :class:`~vllm_hybrid.tools.simulate.sources.MultiTurnWorkload`
    (same ids and prompts), one drive per turn."""
    engine.reset_prefix_cache()
    evicted_before = coupled_evictions(engine.scheduler)
    state_counts = _state_counts(engine)
    shape = _shape(MultiTurnShape, cfg, "multi_turn")
    workload = MultiTurnWorkload(shape, engine.vocab())
    per_turn: list[dict[str, Any]] = []
    results: list[Drive] = []
    for turn in range(cfg.multi_turn_turns):
        # one drive per turn: the workload sends the next turn once this
        # one has finished, and the driver ends when it has
        result = drive(engine, workload, cfg)
        check_finished(result, f"multi_turn turn {turn}")
        turn_cached = result.cached_tokens()
        turn_prompt = sum(t.prompt_tokens for t in result.result.timings.values())
        per_turn.append(
            {
                "turn": turn,
                "prompt_tokens": turn_prompt,
                "cached_tokens": turn_cached,
                "hit_rate": turn_cached / turn_prompt,
                "preemptions": result.preemptions,
            }
        )
        results.append(result)
    cached = sum(t["cached_tokens"] for t in per_turn)
    prompt_tokens = sum(t["prompt_tokens"] for t in per_turn)
    evicted = coupled_evictions(engine.scheduler)
    metrics = {
        "hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "hit_rate_first_turn": per_turn[0]["hit_rate"] if per_turn else None,
        "cached_tokens_first_turn": per_turn[0]["cached_tokens"] if per_turn else None,
        "hit_rate_last_turn": per_turn[-1]["hit_rate"] if per_turn else None,
        "coupled_evictions": None if evicted is None else evicted - evicted_before,
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        **_totals(results),
        "requests": len(per_turn) * cfg.multi_turn_conversations,
    }
    metrics |= state_counts()
    wall = sum(r.wall_s for r in results)
    return {"metrics": metrics, "details": {"turns": per_turn}, "wall_s": wall}


@dataclass(frozen=True)
class Try:
    """One one_long attempt."""

    length: int
    outcome: str
    steps: int
    wall_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "finished"


def try_one_long(engine: Engine, cfg: BenchConfig, length: int) -> Try:
    """Can a ``length``-token prompt finish alone, without preemption?"""
    prompt = wl.one_long_prompt(cfg.seed, engine.vocab(), length)
    key = f"long-{length}"
    batch = Batch([SimRequest(key, prompt, cfg.one_long_output, 0.0)])
    try:
        result = drive(engine, batch, cfg, stop_on_preemption=True)
    except Exception as exc:  # the engine itself failed on this request
        return Try(length, "error", 0, 0.0, f"{type(exc).__name__}: {exc}")
    outcome = result.outcome
    if outcome == "finished":
        produced = len(batch.replies[key])
        if produced != cfg.one_long_output:
            outcome = "short_output"
    engine.reset_prefix_cache()
    return Try(length, outcome, result.steps, round(result.wall_s, 2))


def longest_completing(
    check: Callable[[int], bool], low: int, high: int
) -> tuple[int, list[int]]:
    """Largest n in [low, high] with check(n), assuming monotonicity.

    Returns (n, probed lengths); n is low - 1 when even ``low`` fails.
    """
    probed: list[int] = []
    best = low - 1
    lo, hi = low, high
    while lo <= hi:
        mid = (lo + hi) // 2
        probed.append(mid)
        if check(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best, probed


def run_one_long(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """Binary search for the longest prompt that finishes without preemption."""
    geometry = kv_geometry(engine.scheduler.kv_cache_config)
    max_len = engine.vllm_config.model_config.max_model_len
    high = min(max_len - cfg.one_long_output, cfg.one_long_search_cap)
    tries: list[Try] = []

    def check(length: int) -> bool:
        outcome = try_one_long(engine, cfg, length)
        tries.append(outcome)
        return outcome.ok

    start = time.perf_counter()
    longest, _ = longest_completing(check, 1, high)
    wall = time.perf_counter() - start
    return one_long_metrics(engine, cfg, geometry, longest, tries, wall)


def one_long_metrics(
    engine: Engine | None,
    cfg: BenchConfig,
    geometry: KVGeometry | None,
    longest: int,
    tries: Sequence[Try],
    wall: float,
) -> dict[str, Any]:
    """The one_long result; without an engine (none started) only what the
    geometry tells."""
    reported = None
    if engine is not None:
        reported = engine.vllm_config.cache_config.kv_cache_size_tokens
    bound = geometry.token_bound(cfg.one_long_budget_bytes) if geometry else None
    failures = [t for t in tries if not t.ok]
    metrics = {
        "longest_prompt": longest,
        "reported_capacity_tokens": reported,
        "reported_over_longest": (reported / longest) if reported and longest else None,
        "bound_tokens": bound,
        "longest_over_bound": (longest / bound) if bound else None,
        "tries": len(tries),
        "failed_tries_preempted": sum(t.outcome == "preempted" for t in failures),
        "failed_tries_stalled": sum(t.outcome == "stalled" for t in failures),
        "failed_tries_rejected": sum(t.outcome == "rejected" for t in failures),
    }
    details = {"tries": [asdict(t) for t in tries]}
    return {"metrics": metrics, "details": details, "wall_s": wall}
