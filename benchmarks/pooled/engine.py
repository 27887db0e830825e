"""Engines, and how the benchmark drives them: with the simulator's
:class:`~vllm_hybrid.tools.simulate.drive.Driver` on the engine's core (vLLM
is imported lazily so the pure helpers load fast)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from testing.inproc import engine_core, open_llm
from vllm_hybrid.tools.plan.geometry import KVGeometry
from vllm_hybrid.tools.simulate.drive import Driver, DriveResult
from vllm_hybrid.tools.simulate.session import geometry_summary
from vllm_hybrid.tools.simulate.sources import SimRequest, Workload
from vllm_hybrid.tools.simulate.steps import ExecutedSteps, StepRecord

from .config import BenchConfig
from .pools import KVSample, kv_pools, sample_kv


def engine_kwargs(
    model_path: str, cfg: BenchConfig, prefix_caching: bool, mode: str
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a worker's main engine: the same in every
    mode (the overlay's switch is the worker process's) but for a mode's own
    KV cache dtype (``overlay:turboquant_k8v4``); options left at None are
    vLLM's defaults."""
    dtype = mode.partition(":")[2] or cfg.kv_cache_dtype
    kwargs = {
        "model": model_path,
        "kv_cache_memory_bytes": cfg.budget_bytes,
        "kv_cache_dtype": dtype,
        "kv_cache_dtype_skip_layers": list(cfg.kv_cache_dtype_skip_layers) or None,
        "enable_prefix_caching": prefix_caching,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
        "block_size": cfg.block_size,
        "mamba_block_size": cfg.mamba_block_size if prefix_caching else None,
        "mamba_ssm_cache_dtype": cfg.mamba_ssm_cache_dtype,
        "enforce_eager": cfg.enforce_eager,
        "seed": cfg.seed,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


@dataclass
class Engine:
    """An open ``vllm.LLM`` with the handles the workloads read."""

    llm: Any
    #: the ``vllm.LLM`` arguments it was started with
    kwargs: dict[str, Any]
    start_s: float
    #: the simulator's step observer on this engine's executor (prefill and
    #: decode tokens, preemptions), attached on first use (:meth:`steps`)
    observer: ExecutedSteps | None = None

    @property
    def core(self) -> Any:
        return engine_core(self.llm)

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def vllm_config(self) -> Any:
        return self.llm.llm_engine.vllm_config

    def describe(self) -> dict[str, Any]:
        """Engine facts for the report: the simulator's summary of its KV
        cache (groups, planned pools, capacity, limits), and the bytes its
        pools own now."""
        owned = sum(p.owned_bytes for p in kv_pools(self.scheduler))
        summary = geometry_summary(self.scheduler, self.vllm_config)
        layout = "pooled" if len(summary["pools"]) > 1 else "single"
        return summary | {
            "start_s": round(self.start_s, 2),
            "kv_layout": layout,
            "kv_bytes_total": owned,
        }

    def steps(self) -> ExecutedSteps:
        if self.observer is None:
            self.observer = ExecutedSteps(self.core)
        return self.observer


@contextlib.contextmanager
def open_engine(kwargs: dict[str, Any]) -> Iterator[Engine]:
    """Start an engine of ``kwargs`` and always release it (and vLLM's
    process state)."""
    start = time.perf_counter()
    with open_llm(kwargs) as llm:
        yield Engine(llm, kwargs, time.perf_counter() - start)


class Batch(Workload):
    """Requests all due at once: one try of one_long."""

    def __init__(self, requests: Iterable[SimRequest]) -> None:
        self.requests = list(requests)

    def due(self, now: float) -> list[SimRequest]:
        due, self.requests = self.requests, []
        return due


@dataclass
class Drive:
    """One drive: what the simulator's driver observed, and this process's
    times."""

    result: DriveResult
    wall_s: float
    #: CPU seconds of this process during the drive; unlike wall time it
    #: barely moves when other jobs share the machine's cores.
    cpu_s: float
    samples: list[KVSample]

    @property
    def outcome(self) -> str:
        """finished | stalled | time_limit | preempted | rejected"""
        return "rejected" if self.result.rejected else self.result.outcome


def _work(record: StepRecord) -> float:
    """Tokens a step computed: the driver counts a step that computed none
    towards a stall."""
    return float(record.prefill_tokens + record.decode_tokens)


def drive(
    engine: Engine,
    workload: Workload,
    cfg: BenchConfig,
    geometry: KVGeometry | None = None,
    stop_on_preemption: bool = False,
) -> Drive:
    """Run ``workload`` to its end with the simulator's driver, one engine
    step at a time, sampling the scheduler after each, unless it stalls, runs
    out of time or (if asked) is preempted (docs/benchmarks.md, "How it
    works"); the driver aborts what is left."""
    steps = engine.steps()
    steps.take()
    samples: list[KVSample] = []
    start = time.perf_counter()
    cpu_start = time.process_time()

    def on_step(result: DriveResult) -> str | None:
        if geometry is not None:
            step = result.engine_steps
            samples.append(sample_kv(engine.scheduler, geometry, step))
        if stop_on_preemption and result.steps.preemptions:
            return "preempted"
        if time.perf_counter() - start > cfg.drive_time_limit_s:
            return "time_limit"
        return None

    result = Driver(
        engine.core,
        workload,
        steps.take,
        _work,
        stall_steps=cfg.stall_steps,
        on_step=on_step,
    ).run()
    wall = time.perf_counter() - start
    return Drive(result, wall, time.process_time() - cpu_start, samples)
