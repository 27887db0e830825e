"""Engine glue of pooled mode in upstream's ``kv_cache_utils`` entry points.

``get_kv_cache_configs`` is where the engine core turns the workers' layer
specs and memory into per-worker ``KVCacheConfig`` objects. For hybrid models
in pooled mode it returns :class:`PooledKVCacheConfig` objects from the pure
planner; everything else goes to upstream unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream
from vllm_hybrid.v1.core.pooled_config import (
    HybridKVOptions,
    PooledKVCacheConfig,
    pooled_mode_decision,
)
from vllm_hybrid.v1.core.pooled_planner import (
    PooledBudget,
    PooledPlanError,
    auto_fit_max_model_len,
    describe_plan,
    plan_pooled_kv_cache,
    split_layers,
)

logger = init_logger(__name__)

TARGET = "vllm.v1.core.kv_cache_utils:get_kv_cache_configs"


def _merge_specs(
    kv_cache_specs: list[dict[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec]:
    merged: dict[str, KVCacheSpec] = {}
    for worker_specs in kv_cache_specs:
        for name, spec in worker_specs.items():
            if merged.setdefault(name, spec) != spec:
                raise ValueError(f"workers disagree on the KV cache spec of {name}")
    return merged


def null_blocks_may_overlap(vllm_config: Any) -> bool:
    """Whether no kernel writes through a null block id in this engine.

    Upstream pads CUDA-graph batches with state id 0 (``NULL_BLOCK_ID``), so
    state kernels write garbage there; attention never writes through a null
    block (padded slots are -1). Without CUDA graphs (the CPU backend, or
    ``--enforce-eager``) the null blocks can overlap owned blocks and the
    arena does not lose a whole state block to them.
    """
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return True
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is None or mode == CUDAGraphMode.NONE


def plan_pooled_configs(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[PooledKVCacheConfig] | None:
    """Pooled configs for every worker, or None to use upstream's plan."""
    if not pooled_mode_decision(vllm_config).enabled:
        return None
    merged = _merge_specs(kv_cache_specs)
    split = split_layers(merged)
    if split.token is None:
        logger.info(
            "vllm-hybrid pooled KV mode does not apply (%s); using upstream's "
            "single shared KV pool",
            split.reason,
        )
        return None
    layout = vllm_config.cache_config.kv_cache_layout
    if layout is not None:
        resolved = vllm_config.cache_config.get_resolved_kv_cache_layout()
        if not resolved.is_block_compact:
            logger.info(
                "vllm-hybrid pooled KV mode needs a block-compact KV cache "
                "layout, got %s; using upstream's single shared KV pool",
                resolved.name,
            )
            return None
    # Every rank must hand out the same block ids: plan all ranks with the
    # smallest budget.
    budget = PooledBudget(
        arena_bytes=min(available_memory),
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        null_blocks_overlap=null_blocks_may_overlap(vllm_config),
    )
    model_config = vllm_config.model_config
    if getattr(model_config, "original_max_model_len", None) == -1:
        fitted = auto_fit_max_model_len(split, budget)
        if fitted <= 0:
            raise PooledPlanError(
                "Cannot auto-fit max_model_len in pooled mode: the KV cache "
                f"budget of {budget.arena_bytes / 2**20:.2f} MiB cannot hold one "
                "request's state and one attention block. Raise "
                "--kv-cache-memory-bytes or --gpu-memory-utilization."
            )
        if fitted < budget.max_model_len:
            logger.info(
                "Auto-fit max_model_len (pooled mode): reduced from %d to %d to "
                "fit the KV cache budget",
                budget.max_model_len,
                fitted,
            )
            model_config.max_model_len = fitted
            budget = dataclasses.replace(budget, max_model_len=fitted)
    config = plan_pooled_kv_cache(split, budget)
    config.prefix_cache_retention_interval = (
        vllm_config.cache_config.prefix_cache_retention_interval
    )
    config.couple_prefix_caches = HybridKVOptions.from_vllm_config(
        vllm_config
    ).couple_prefix_caches
    logger.info(describe_plan(config))
    return [copy.deepcopy(config) for _ in kv_cache_specs]


def get_kv_cache_configs(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
):
    """Upstream's ``get_kv_cache_configs``, pooled for hybrid models."""
    pooled = plan_pooled_configs(vllm_config, kv_cache_specs, available_memory)
    if pooled is not None:
        from vllm_hybrid.v1.core.sched.scheduler import select_scheduler

        select_scheduler(vllm_config, pooled[0])
        return pooled
    return upstream(TARGET)(vllm_config, kv_cache_specs, available_memory)
