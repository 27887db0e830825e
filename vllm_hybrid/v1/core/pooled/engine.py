"""Engine glue of pooled mode: the workers' configs (asked first by the
replacement of upstream's ``get_kv_cache_configs``, which falls back to
upstream on None) and the capacity the engine logs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_hybrid.config.hybrid_kv import HybridKVOptions
from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.capacity import pooled_capacity
from vllm_hybrid.v1.core.pooled.layers import (
    PoolSplit,
    equalize_stage_blocks,
    split_layers,
)
from vllm_hybrid.v1.core.pooled.planner import (
    PooledBudget,
    PooledPlanError,
    auto_fit_max_model_len,
    describe_plan,
    plan_pooled_kv_cache,
)
from vllm_hybrid.v1.core.pooled.policy.positions import plan_prefill_checkpoints
from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def _merge_specs(
    kv_cache_specs: list[dict[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec]:
    merged: dict[str, KVCacheSpec] = {}
    for worker_specs in kv_cache_specs:
        for name, spec in worker_specs.items():
            if merged.setdefault(name, spec) != spec:
                raise ValueError(f"workers disagree on the KV cache spec of {name}")
    return merged


def null_blocks_may_overlap(vllm_config: VllmConfig) -> bool:
    """Whether no kernel writes through a null block id in this engine: only
    the V1 runner without CUDA graphs (CPU, or ``--enforce-eager`` with
    ``VLLM_USE_V2_MODEL_RUNNER=0``), since CUDA graphs pad with state id 0
    and V2's dummy runs write through it (docs/pooled-mode.md, "Layout")."""
    import vllm.envs as envs
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return True
    if envs.VLLM_USE_V2_MODEL_RUNNER is not False:
        return False
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is None or mode == CUDAGraphMode.NONE


def _unusable_layout(vllm_config: VllmConfig) -> str | None:
    """The log line for a preset KV cache layout that is not block-compact
    (pooled views need each page as one contiguous run), or None; upstream's
    single pool then serves or refuses it."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    if vllm_config.cache_config.kv_cache_layout is None:
        return None
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    if layout.is_block_compact:
        return None
    compact = ", ".join(m.name for m in KVCacheLayout if m.is_block_compact)
    return (
        f"vllm-hybrid pooled KV mode needs a block-compact KV cache layout "
        f"({compact}), got {layout.name}; using upstream's single shared KV pool. "
        "Leave the layout to vLLM's resolution or choose one of those for "
        "pooled mode."
    )


def _stage_mismatch(configs: list[PooledKVCacheConfig]) -> str | None:
    """Why pipeline stages' plans cannot share one scheduler, or None: their
    geometry and group specs must agree, since the scheduler reads one."""
    first = configs[0]

    def shape(config: PooledKVCacheConfig) -> tuple:
        return (
            config.layout,
            [(p.kind, p.group_ids, p.block_bytes, p.num_blocks) for p in config.pools],
            [g.kv_cache_spec for g in config.kv_cache_groups],
        )

    for stage, config in enumerate(configs[1:], start=1):
        if shape(config) != shape(first):
            return f"pipeline stage {stage} has other KV cache specs than stage 0"
    return None


def _log_stage_padding(splits: list[PoolSplit], padded: list[PoolSplit]) -> None:
    """Log what equal blocks cost the stages, when their own blocks differ."""
    own = [(split.token.block_bytes, split.state.block_bytes) for split in splits]
    if len(set(own)) == 1:
        return
    token, state = padded[0].token.block_bytes, padded[0].state.block_bytes
    used = "; ".join(
        f"stage {stage}: token {tb:,} of {token:,} B, state {sb:,} of {state:,} B"
        for stage, (tb, sb) in enumerate(own)
    )
    logger.info(
        "vllm-hybrid pooled KV mode: pipeline stages hold blocks of different "
        "bytes; every stage's blocks are padded to the largest so that one id "
        "space and one boundary fit all (%s)",
        used,
    )


def _log_not_pooled(reason: str) -> None:
    logger.info(
        "vllm-hybrid pooled KV mode does not apply (%s); using upstream's "
        "single shared KV pool",
        reason,
    )


def plan_pooled_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[PooledKVCacheConfig] | None:
    """Pooled configs for every worker, or None to use upstream's plan:
    tensor-parallel ranks get copies of one plan, pipeline stages one plan
    each from their own layers."""
    if not pooled_mode_decision(vllm_config).enabled:
        return None
    pipeline = vllm_config.parallel_config.pipeline_parallel_size > 1
    if pipeline:
        splits = [split_layers(specs) for specs in kv_cache_specs]
    else:
        splits = [split_layers(_merge_specs(kv_cache_specs))]
    reason = next((split.reason for split in splits if split.token is None), None)
    if reason is not None:
        _log_not_pooled(reason)
        return None
    if pipeline:
        padded = equalize_stage_blocks(splits)
        _log_stage_padding(splits, padded)
        splits = padded
    unusable = _unusable_layout(vllm_config)
    if unusable is not None:
        logger.info(unusable)
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
        fitted = min(auto_fit_max_model_len(split, budget) for split in splits)
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
    configs = [plan_pooled_kv_cache(split, budget) for split in splits]
    mismatch = _stage_mismatch(configs) if pipeline else None
    if mismatch is not None:
        _log_not_pooled(mismatch)
        return None
    options = HybridKVOptions.from_vllm_config(vllm_config)
    for config in configs:
        config.prefix_cache_retention_interval = (
            vllm_config.cache_config.prefix_cache_retention_interval
        )
        config.retain_turn_ends = options.retain_turn_ends
        config.token_moves = options.token_moves
        # align mode (prefix caching on) only: the policy says 0 otherwise
        (
            config.prefill_checkpoint_interval,
            config.prefill_checkpoint_anchor,
        ) = plan_prefill_checkpoints(
            config, budget.max_model_len, options.prefill_checkpoint_interval
        )
    logger.info(describe_plan(configs[0]))
    if pipeline:
        return configs
    return [copy.deepcopy(configs[0]) for _ in kv_cache_specs]


def update_pooled_capacity(
    vllm_config: VllmConfig, kv_cache_config: PooledKVCacheConfig, device_name: str
) -> None:
    """Store and log the capacity of a pooled plan (the engine's one line)."""
    capacity = pooled_capacity(kv_cache_config, vllm_config.model_config.max_model_len)
    cache_config = vllm_config.cache_config
    cache_config.kv_cache_size_tokens = capacity.token_capacity
    cache_config.kv_cache_max_concurrency = capacity.max_concurrency
    logger.info_once(
        "%s KV cache size: %s tokens (token pool only, after one request's "
        "state), Maximum concurrency for %s tokens per request: %.2fx (token "
        "and state pools)",
        device_name,
        f"{capacity.token_capacity:,}",
        f"{vllm_config.model_config.max_model_len:,}",
        capacity.max_concurrency,
    )
