"""The many_short and one_long workloads on an open engine.

many_short is the simulator's workload, run as ``vllm-hybrid simulate`` runs
it (one drive) and counted by its
:func:`~vllm_hybrid.tools.simulate.session.summarize`, under its names; what
only a real engine shows is added: bytes needed against bytes reserved, and
this process's times. one_long searches for the longest prompt a budget
serves. Prefix hits, state copies and checkpoints of multi-turn traffic are
the simulator's to count (``vllm-hybrid simulate --workload multi_turn``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from testing.inproc import llm_vocab
from vllm_hybrid.tools import workloads as wl
from vllm_hybrid.tools.plan.geometry import KVGeometry, kv_geometry
from vllm_hybrid.tools.simulate.session import summarize
from vllm_hybrid.tools.simulate.sources import (
    ManyShortShape,
    ManyShortWorkload,
    SimRequest,
)

from .config import BenchConfig
from .engine import Batch, Drive, Engine, drive
from .pools import KVSample


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


def _counted(result: Drive) -> dict[str, Any]:
    """The simulator's counted figures of a drive, and decoded tokens per
    second of wall and CPU time."""
    counted = summarize(result.result, 0.0, 0.0)["counted"]
    for key in ("copy_bytes", "floor_tokens", "checkpoints_cached"):
        counted.pop(key)
    out = counted["output_tokens"]
    return counted | {
        "output_tok_per_s": _per(out, result.wall_s),
        "cpu_s": result.cpu_s,
        "output_tok_per_cpu_s": _per(out, result.cpu_s),
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
            f"{result.result.engine_steps} steps"
        )


def run_many_short(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """The simulator's many_short prompts, all at once, under the main
    engine's budget."""
    geometry = kv_geometry(engine.scheduler.kv_cache_config)
    shape = _shape(ManyShortShape, cfg, "many_short")
    result = drive(
        engine, ManyShortWorkload(shape, llm_vocab(engine.llm)), cfg, geometry
    )
    check_finished(result, "many_short")
    metrics = {
        **_peak_samples(result.samples),
        **_counted(result),
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
    prompt = wl.one_long_prompt(cfg.seed, llm_vocab(engine.llm), length)
    key = f"long-{length}"
    batch = Batch([SimRequest(key, prompt, cfg.one_long_output, 0.0)])
    try:
        result = drive(engine, batch, cfg, stop_on_preemption=True)
    except Exception as exc:  # the engine itself failed on this request
        return Try(length, "error", 0, 0.0, f"{type(exc).__name__}: {exc}")
    outcome = result.outcome
    timings = result.result.timings  # a rejected request has none
    if outcome == "finished" and timings[key].output_tokens != cfg.one_long_output:
        outcome = "short_output"
    engine.llm.reset_prefix_cache()
    return Try(length, outcome, result.result.engine_steps, round(result.wall_s, 2))


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
    engine: Engine,
    cfg: BenchConfig,
    geometry: KVGeometry,
    longest: int,
    tries: Sequence[Try],
    wall: float,
) -> dict[str, Any]:
    """The one_long result: the longest prompt against the engine's reported
    capacity and against the budget's bound."""
    reported = engine.vllm_config.cache_config.kv_cache_size_tokens
    bound = geometry.token_bound(cfg.one_long_budget_bytes)
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
