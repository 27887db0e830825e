"""Engines, and how the benchmark drives them: with the simulator's
:class:`~vllm_hybrid.tools.simulate.drive.Driver` on the engine's core (vLLM
is imported lazily so the pure helpers load fast)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_hybrid.tools.inproc import engine_core, llm_vocab, open_llm, top2_gap
from vllm_hybrid.tools.plan.geometry import KVGeometry
from vllm_hybrid.tools.simulate.drive import Driver, DriveResult
from vllm_hybrid.tools.simulate.probes import (
    CheckpointCount,
    count_state_checkpoints,
)
from vllm_hybrid.tools.simulate.sources import SimRequest, Workload
from vllm_hybrid.tools.simulate.steps import ExecutedSteps, StepRecord

from .config import BenchConfig
from .pools import (
    KVSample,
    kv_layout_name,
    kv_pools,
    pool_record,
    sample_kv,
)


@dataclass(frozen=True)
class EngineSpec:
    """Arguments of one engine; identical for both modes by construction."""

    model_path: str
    budget_bytes: int
    prefix_caching: bool
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool
    seed: int
    block_size: int | None = None
    mamba_block_size: int | None = None
    couple_prefix_caches: bool = True
    mamba_ssm_cache_dtype: str = BenchConfig.mamba_ssm_cache_dtype
    kv_cache_dtype: str = BenchConfig.kv_cache_dtype
    retain_turn_ends: bool = True
    kv_cache_dtype_skip_layers: tuple[str, ...] = ()
    pooled: bool = True
    prefill_checkpoint_interval: int | None = None
    prefix_match_unit: int | None = None
    prefix_cache_retention_interval: int | None = 0

    @classmethod
    def from_config(
        cls, model_path: str, cfg: BenchConfig, prefix_caching: bool, mode: str
    ) -> EngineSpec:
        """The main engine of ``mode``: the fields ``cfg`` names alike, the
        upstream_best tuning flags in that mode only."""
        given = {
            f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)
        }
        if mode != "upstream_best":
            given |= {"prefix_match_unit": None, "prefix_cache_retention_interval": 0}
        return cls(
            model_path, prefix_caching=prefix_caching, pooled=mode != "single", **given
        )

    def llm_kwargs(self) -> dict[str, Any]:
        # turn-end retention explicitly, whatever the overlay's default; the
        # other options only where they differ from the engine's default
        hybrid_kv = {
            "retain_turn_ends": self.retain_turn_ends,
            "couple_prefix_caches": None if self.couple_prefix_caches else False,
            "pooled": None if self.pooled else False,
            "prefill_checkpoint_interval": self.prefill_checkpoint_interval,
        }
        extra = {
            "block_size": self.block_size,
            "prefix_match_unit": self.prefix_match_unit,
            "mamba_block_size": self.mamba_block_size if self.prefix_caching else None,
            "kv_cache_dtype_skip_layers": list(self.kv_cache_dtype_skip_layers) or None,
        }
        extra = {k: v for k, v in extra.items() if v is not None}
        if self.prefix_cache_retention_interval != 0:
            extra["prefix_cache_retention_interval"] = (
                self.prefix_cache_retention_interval
            )
        hybrid_kv = {k: v for k, v in hybrid_kv.items() if v is not None}
        extra["additional_config"] = {"hybrid_kv": hybrid_kv}
        return extra | {
            "model": self.model_path,
            "kv_cache_memory_bytes": self.budget_bytes,
            "kv_cache_dtype": self.kv_cache_dtype,
            "enable_prefix_caching": self.prefix_caching,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "mamba_ssm_cache_dtype": self.mamba_ssm_cache_dtype,
        }


@dataclass
class Engine:
    """An open ``vllm.LLM`` with the handles the workloads read."""

    llm: Any
    spec: EngineSpec
    start_s: float
    #: measurement helpers attached to this engine (step observer, probe)
    probes: dict[str, Any] = field(default_factory=dict)

    @property
    def core(self) -> Any:
        return engine_core(self.llm)

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def vllm_config(self) -> Any:
        return self.llm.llm_engine.vllm_config

    def vocab(self) -> list[int]:
        return llm_vocab(self.llm)

    def describe(self) -> dict[str, Any]:
        """Engine facts for the report: capacity, pools, plan."""
        cache = self.vllm_config.cache_config
        pools = kv_pools(self.scheduler)
        return {
            "start_s": round(self.start_s, 2),
            "kv_layout": kv_layout_name(pools),
            "pools": [pool_record(p) for p in pools],
            "kv_bytes_total": sum(p.owned_bytes for p in pools),
            "reported_capacity_tokens": getattr(cache, "kv_cache_size_tokens", None),
            "max_model_len": self.vllm_config.model_config.max_model_len,
            "max_num_batched_tokens": (
                self.vllm_config.scheduler_config.max_num_batched_tokens
            ),
            "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
            "group_block_sizes": [
                g.kv_cache_spec.block_size
                for g in self.scheduler.kv_cache_config.kv_cache_groups
            ],
        }

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def steps(self) -> ExecutedSteps:
        """The simulator's step observer on this engine's executor (prefill
        and decode tokens, preemptions, align-mode state copies), attached on
        first use."""
        if "steps" not in self.probes:
            self.probes["steps"] = ExecutedSteps(self.core)
        return self.probes["steps"]

    def count_checkpoints(self) -> CheckpointCount | None:
        """Count state checkpoints entered into the prefix cache with the
        simulator's probe (attached once), so both tools count them alike;
        None without prefix caching (no align-mode state groups)."""
        if not self.spec.prefix_caching:
            return None
        if "checkpoints" not in self.probes:
            self.probes["checkpoints"] = count_state_checkpoints(self.scheduler)
        return self.probes["checkpoints"]


@contextlib.contextmanager
def open_engine(spec: EngineSpec, **llm_options: Any) -> Iterator[Engine]:
    """Start an engine (``llm_options``: more ``vllm.LLM`` arguments) and
    always release it (and vLLM's process state)."""
    start = time.perf_counter()
    with open_llm(spec.llm_kwargs() | llm_options) as llm:
        yield Engine(llm, spec, time.perf_counter() - start)


def start_error(spec: EngineSpec) -> str | None:
    """Why an engine with ``spec`` does not start, or None if it does."""
    try:
        with open_engine(spec):
            return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


class Batch(Workload):
    """Requests all due at once, their replies kept: one drive of one_long
    or same_tokens."""

    needs_replies = True

    def __init__(self, requests: Iterable[SimRequest]) -> None:
        self.requests = list(requests)
        self.replies: dict[str, list[int]] = {}

    def due(self, now: float) -> list[SimRequest]:
        due, self.requests = self.requests, []
        return due

    def finished(self, request_id: str, reply: Sequence[int], now: float) -> None:
        self.replies[request_id] = [int(t) for t in reply]


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

    @property
    def steps(self) -> int:
        return self.result.engine_steps

    @property
    def preemptions(self) -> int:
        return self.result.steps.preemptions

    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.result.timings.values())

    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.result.timings.values())

    def top2_gaps(self, key: str) -> list[float | None]:
        return [top2_gap(p.values()) for p in self.result.logprobs.get(key, [])]


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
    """Run what ``workload`` makes due now, one engine step at a time,
    sampling the scheduler, until all of it has finished, stalled, run out of
    time or (if asked) been preempted (docs/benchmarks.md, "How it works");
    the driver aborts what is left."""
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
        if all(t.finished is not None for t in result.timings.values()):
            return "finished"
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
