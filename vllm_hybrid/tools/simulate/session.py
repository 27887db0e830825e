"""One engine variant on one workload, in this process: the figures.

:class:`~.spec.SimulationSpec` is everything the variants of one comparison
share (model, device, budget, workload, clock); :class:`~.spec.Variant` is
what one engine sets on top (the overlay on or off, cache options,
``hybrid_kv`` options). :func:`run_variant` opens the engine, drives the workload and
returns a JSON-ready summary: counted figures, modeled times, the engine's
geometry and a timeline. Which mode runs is this process's choice
(``VLLM_HYBRID_KV``); :mod:`.runner` starts one process per variant.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.plan.geometry import kv_geometry
from vllm_hybrid.tools.plan.request import model_dir
from vllm_hybrid.tools.simulate.clock import (
    GPU_PROFILES,
    CostModel,
    ModelCosts,
    cuda_runner,
    profile_for_memory,
)
from vllm_hybrid.tools.simulate.drive import Driver, DriveResult
from vllm_hybrid.tools.simulate.engine import SimEngine, open_engine
from vllm_hybrid.tools.simulate.followups import (
    FOLLOWUPS,
    read_followup_trace,
    trace_format,
)
from vllm_hybrid.tools.simulate.host import SchedulerCpu
from vllm_hybrid.tools.simulate.metrics import (
    bench_serve_metrics,
    latencies,
    per_request,
    percentiles,
)
from vllm_hybrid.tools.simulate.probes import count_state_checkpoints
from vllm_hybrid.tools.simulate.sources import (
    CLOSED_LOOP,
    FollowupWorkload,
    TraceWorkload,
    Workload,
)
from vllm_hybrid.tools.simulate.spec import SimulationSpec, Variant, WorkloadSpec
from vllm_hybrid.tools.simulate.steps import StepRecord
from vllm_hybrid.tools.simulate.trace import read_trace
from vllm_hybrid.tools.tracegen.common import shape_from_json
from vllm_hybrid.tools.workloads import allowed_token_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler

#: Ids below this are special tokens in the vocabularies simulated (the
#: project's workloads draw prompt ids from the rest).
SPECIAL_IDS = range(3)


def make_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    """The workload of ``spec`` over a vocabulary of ``vocab_size``."""
    if spec.kind == "mooncake" and trace_format(Path(spec.trace)) == FOLLOWUPS:
        # cut by request count only (the command line refuses a window)
        followups = read_followup_trace(Path(spec.trace), spec.requests)
        return FollowupWorkload(followups, vocab_size)
    if spec.kind == "mooncake":
        fmt = spec.trace_format()
        records = read_trace(
            Path(spec.trace), spec.start_s, spec.end_s, spec.requests, fmt
        )
        return TraceWorkload(records, vocab_size, fmt.block_tokens)
    vocab = allowed_token_ids(vocab_size, SPECIAL_IDS)
    if spec.kind not in CLOSED_LOOP:
        raise ValueError(f"unknown workload {spec.kind!r}")
    shape_class, workload_class = CLOSED_LOOP[spec.kind]
    return workload_class(shape_from_json(shape_class, spec.shape), vocab)


def cost_model(engine: SimEngine, spec: SimulationSpec) -> CostModel:
    """The modeled clock of this engine (its KV geometry, the spec's GPU)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_hybrid.tools.plan.config import layer_kinds

    kv_config = engine.scheduler.kv_cache_config
    kv_per_token = 0
    for group in kv_config.kv_cache_groups:
        spec_ = group.kv_cache_spec
        if not isinstance(spec_, MambaSpec):
            per = spec_.page_size_bytes // spec_.block_size
            kv_per_token += per * len(group.layer_names)
    kinds = layer_kinds(engine.vllm_config)
    costs = ModelCosts.from_config(
        engine.vllm_config,
        kv_bytes_per_token=kv_per_token,
        state_bytes=kv_geometry(kv_config).state_bytes_per_request,
        weights_bytes=spec.weights_bytes,
        attention_layers=kinds.attention,
        state_layers=kinds.state,
    )
    gpu = (
        GPU_PROFILES[spec.gpu_profile]
        if spec.gpu_profile
        else profile_for_memory(spec.request.gpu_memory_gib)
    )
    return CostModel(costs, gpu, runner=cuda_runner())


def geometry_summary(scheduler: Scheduler, vllm_config: VllmConfig) -> dict[str, Any]:
    """An engine's KV cache as it started: groups, pools, capacity (of a
    simulated engine, and of ``bench_pooled``'s real ones)."""
    from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig

    config = scheduler.kv_cache_config
    cache = vllm_config.cache_config
    groups = [
        {
            "kind": type(g.kv_cache_spec).__name__,
            "layers": len(g.layer_names),
            "block_size": g.kv_cache_spec.block_size,
            "page_bytes": g.kv_cache_spec.page_size_bytes,
        }
        for g in config.kv_cache_groups
    ]
    if isinstance(config, PooledKVCacheConfig):
        pools = [
            {"kind": p.kind.value, "blocks": p.num_blocks, "block_bytes": p.block_bytes}
            for p in config.pools
        ]
    else:
        total = sum(t.size for t in config.kv_cache_tensors)
        pools = [
            {
                "kind": "shared",
                "blocks": config.num_blocks,
                "block_bytes": total // max(1, config.num_blocks),
            }
        ]
    limits = vllm_config.scheduler_config
    return {
        "groups": groups,
        "pools": pools,
        "token_capacity": getattr(cache, "kv_cache_size_tokens", None),
        "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "max_model_len": vllm_config.model_config.max_model_len,
        "prefix_match_unit": cache.prefix_match_unit,
        "prefix_cache_retention_interval": cache.prefix_cache_retention_interval,
        "mamba_block_size": cache.mamba_block_size,
        "async_scheduling": limits.async_scheduling,
    }


def summarize(
    result: DriveResult, copy_bytes: float, checkpoints: float
) -> dict[str, Any]:
    """Counted and modeled figures of one run."""
    steps: StepRecord = result.steps
    timings = result.timings.values()
    done = [t for t in timings if t.finished is not None]
    prompt = sum(t.prompt_tokens for t in timings if t.first_token is not None)
    hit = sum(t.cached_tokens for t in timings if t.first_token is not None)
    output = sum(t.output_tokens for t in timings)
    floors = [
        t.floor_tokens
        for t in timings
        if t.first_token is not None and t.floor_tokens is not None
    ]
    counted = {
        "requests": len(result.timings),
        "finished": len(done),
        "rejected": len(result.rejected),
        "outcome": result.outcome,
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "hit_rate": hit / prompt if prompt else None,
        "prefill_tokens": steps.prefill_tokens,
        # prompt tokens no cache could have served (traces with follow-ups)
        "floor_tokens": sum(floors) if floors else None,
        "decode_tokens": steps.decode_tokens,
        "output_tokens": output,
        "preemptions": steps.preemptions,
        "state_copies": steps.state_copies,
        "state_self_copies": steps.state_self_copies,
        "state_reads_elsewhere": steps.state_reads_elsewhere,
        "cow_copies": steps.cow_copies,
        "token_moves": steps.token_moves,
        "copy_bytes": copy_bytes,
        "checkpoints_cached": checkpoints,
        "peak_running": result.running_peak,
        "mean_running": result.running_sum / max(1, result.engine_steps),
        "engine_steps": result.engine_steps,
    }
    makespan = result.makespan_s
    seconds = latencies(timings)
    modeled = {
        "makespan_s": makespan,
        "ttft_s": percentiles(seconds["ttft"]),
        "tpot_s": percentiles(seconds["tpot"]),
        "e2e_s": percentiles(seconds["e2el"]),
        "output_tok_per_s": output / makespan if makespan else None,
        "prefill_tok_per_s": steps.prefill_tokens / makespan if makespan else None,
        "mean_running": result.running_time / makespan if makespan else None,
    }
    return {
        "counted": counted,
        "modeled": modeled,
        "bench_serve": bench_serve_metrics(result.timings, makespan),
    }


def run_variant(
    spec: SimulationSpec, variant: Variant, line: int = 0
) -> dict[str, Any]:
    """Run ``variant`` on ``spec``'s workload in this process (``line``: the
    terminal line of its progress bar, when several run at once)."""
    from vllm_hybrid.tools.simulate.engine import overlay_active

    if overlay_active() != variant.overlay:
        raise RuntimeError(
            f"variant {variant.name} needs the overlay "
            f"{'on' if variant.overlay else 'off'} (VLLM_HYBRID_KV)"
        )
    started = time.perf_counter()
    with (
        model_dir(spec.request.model) as (directory, _),
        open_engine(
            spec.request,
            directory,
            variant.options(),
            async_scheduling=spec.async_scheduling,
        ) as engine,
    ):
        checkpoints = count_state_checkpoints(engine.scheduler)
        clock = cost_model(engine, spec)
        block_bytes = _copied_block_bytes(engine)
        workload = make_workload(spec.workload, engine.vocab_size())

        def seconds(record: StepRecord) -> float:
            return clock.step_seconds(
                record,
                _copy_bytes(record, clock, block_bytes),
                record.copies_moved,
            )

        progress = _progress_bar(spec, variant, workload, line)
        scheduler_cpu = SchedulerCpu()
        driver = Driver(
            engine.core,
            workload,
            engine.executor.take_records,
            seconds,
            sample_every_s=spec.sample_every_s,
            progress=progress,
            scheduler_cpu=scheduler_cpu,
        )
        try:
            result = driver.run()
        finally:
            if progress is not None:
                progress.close()
        summary = summarize(
            result,
            _copy_bytes(result.steps, clock, block_bytes),
            checkpoints.checkpoints,
        )
        summary["geometry"] = geometry_summary(engine.scheduler, engine.vllm_config)
        if spec.per_request:
            prefill = engine.executor.observer.prefill_by_request
            summary["requests"] = per_request(result.timings, prefill)
        summary["host"] = scheduler_cpu.summary()
    summary["variant"] = dataclasses.asdict(variant)
    summary["gpu"] = clock.gpu.name
    summary["timeline"] = [dataclasses.astuple(p) for p in result.timeline]
    summary["wall_s"] = time.perf_counter() - started
    return summary


def _copy_bytes(
    record: StepRecord, clock: CostModel, block_bytes: tuple[int, int]
) -> float:
    """Bytes a step's copies move on the clock's runner: the states it
    copies (``StepRecord.copies_moved``), copy-on-write blocks and token
    blocks moved off the arena's boundary (``block_bytes``: one state-pool
    and one token-pool block, :func:`_copied_block_bytes`)."""
    cow_bytes, token_bytes = block_bytes
    states = record.copies_moved * clock.model.state_bytes
    return states + record.cow_copies * cow_bytes + record.token_moves * token_bytes


def _copied_block_bytes(engine: SimEngine) -> tuple[int, int]:
    """Bytes one copy-on-write block copy moves (the block of the pool the
    state groups use: every layer's page of one block id) and one moved
    token block (0 without a token pool)."""
    pools = geometry_summary(engine.scheduler, engine.vllm_config)["pools"]
    state = [p["block_bytes"] for p in pools if p["kind"] in ("state", "shared")]
    token = [p["block_bytes"] for p in pools if p["kind"] == "token"]
    return (state[0] if state else 0, token[0] if token else 0)


def _progress_bar(
    spec: SimulationSpec, variant: Variant, workload: Workload, line: int
) -> Any:
    if not spec.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=workload.total,
        desc=variant.name,
        unit="req",
        mininterval=2.0,
        position=line,
    )
