"""Engines and the loop that drives them step by step (vLLM is imported
lazily so the pure helpers load fast)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_hybrid.tools.inproc import engine_core, llm_vocab, top2_gaps
from vllm_hybrid.tools.simulate.probes import (
    CheckpointCount,
    count_state_checkpoints,
)
from vllm_hybrid.tools.simulate.steps import StepObserver, state_geometry

from .config import BenchConfig
from .pools import (
    KVGeometry,
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
    def scheduler(self) -> Any:
        return engine_core(self.llm).scheduler

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

    def steps(self) -> StepObserver:
        """The simulator's step observer on this engine's scheduler outputs
        (prefill and decode tokens, preemptions, align-mode state copies),
        attached on first use; ``total`` sums every step since."""
        observer = self.probes.get("steps")
        if observer is None:
            scheduler = self.scheduler
            mode = self.vllm_config.cache_config.mamba_cache_mode
            observer = StepObserver(*state_geometry(scheduler.kv_cache_config, mode))
            schedule = scheduler.schedule

            def observed(*args: Any, **kwargs: Any) -> Any:
                output = schedule(*args, **kwargs)
                observer.observe(output)
                return output

            self.probes["steps"] = observer
            scheduler.schedule = observed
        return observer

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
    from vllm import LLM

    start = time.perf_counter()
    llm = None
    try:
        llm = LLM(**spec.llm_kwargs() | llm_options)
        yield Engine(llm, spec, time.perf_counter() - start)
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        with contextlib.suppress(Exception):
            cleanup_dist_env_and_memory()


def start_error(spec: EngineSpec) -> str | None:
    """Why an engine with ``spec`` does not start, or None if it does."""
    try:
        with open_engine(spec):
            return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Submission:
    """One request to add: our id, its prompt ids and its output length."""

    key: str
    prompt: list[int]
    max_tokens: int
    #: top log-probabilities to return per output token (None: none)
    logprobs: int | None = None


@dataclass
class DriveResult:
    """Outcome of driving a batch of requests to completion (or a limit)."""

    outputs: dict[str, Any]
    steps: int
    wall_s: float
    samples: list[KVSample]
    preemptions: int
    #: finished | stalled | time_limit | preempted | rejected
    outcome: str
    detail: str = ""
    #: CPU seconds of this process during the drive; unlike wall time it
    #: barely moves when other jobs share the machine's cores.
    cpu_s: float = 0.0

    def output_tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.outputs.values())

    def token_ids(self, key: str) -> list[int]:
        return [int(t) for t in self.outputs[key].outputs[0].token_ids]

    def top2_gaps(self, key: str) -> list[float | None]:
        return top2_gaps(self.outputs[key].outputs[0])


def _progress(scheduler: Any) -> int:
    """A number that grows whenever the engine computes any token."""
    return sum(
        r.num_computed_tokens + r.num_output_tokens for r in scheduler.requests.values()
    )


def drive(
    engine: Engine,
    submissions: Sequence[Submission],
    cfg: BenchConfig,
    geometry: KVGeometry | None = None,
    stop_on_preemption: bool = False,
) -> DriveResult:
    """Add every request, then step the engine by hand, sampling the
    scheduler, until all are finished, stalled, out of time or (if asked)
    preempted (docs/benchmarks.md, "How it works"); the rest is aborted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm_engine = engine.llm.llm_engine
    scheduler = engine.scheduler
    internal: dict[str, str] = {}

    for sub in submissions:
        # Random weights emit EOS at random: ignore it so lengths are fixed.
        params = SamplingParams(
            max_tokens=sub.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=sub.logprobs,
        )
        try:
            internal[sub.key] = llm_engine.add_request(
                sub.key, TokensPrompt(prompt_token_ids=sub.prompt), params
            )
        except Exception as exc:  # validation (e.g. longer than max_model_len)
            _abort(llm_engine, internal.values())
            error = f"{type(exc).__name__}: {exc}"
            return DriveResult({}, 0, 0.0, [], 0, "rejected", error)
    outputs: dict[str, Any] = {}
    samples: list[KVSample] = []
    observed = engine.steps().total
    preempted_before = observed.preemptions
    start = time.perf_counter()
    cpu_start = time.process_time()
    steps = idle = 0
    last_progress = -1
    outcome, detail = "finished", ""
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        if geometry is not None:
            samples.append(sample_kv(scheduler, geometry, steps))
        progress = _progress(scheduler) + len(outputs)
        idle = idle + 1 if progress == last_progress else 0
        last_progress = progress
        if stop_on_preemption and observed.preemptions > preempted_before:
            outcome = "preempted"
        elif idle >= cfg.stall_steps:
            outcome = "stalled"
        elif time.perf_counter() - start > cfg.drive_time_limit_s:
            outcome = "time_limit"
        if outcome != "finished":
            _abort(llm_engine, [internal[k] for k in internal if k not in outputs])
            break
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    preemptions = observed.preemptions - preempted_before
    return DriveResult(
        outputs, steps, wall, samples, preemptions, outcome, detail, cpu_s=cpu
    )


def _abort(llm_engine: Any, internal_ids: Iterable[str]) -> None:
    ids = list(internal_ids)
    if ids:
        llm_engine.abort_request(ids, internal=True)
