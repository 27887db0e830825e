"""Replacement of upstream's ``get_kv_cache_coordinator``: pooled configs get
the pooled coordinators (:mod:`vllm_hybrid.v1.core.pooled.coordinator`),
hybrid single-pool configs with prefix caching upstream's hybrid coordinator
with turn-end retention (:mod:`vllm_hybrid.v1.core.pooled.retention`), every other
config upstream's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.coordinator import (
    PooledHybridKVCacheCoordinator,
    PooledNoPrefixCacheCoordinator,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.core.turn_ends import (
    RETAIN_ATTRIBUTE,
    TurnEndHybridKVCacheCoordinator,
    has_align_state_groups,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
    from vllm.v1.kv_cache_interface import KVCacheConfig


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    scheduler_block_size: int,
    hash_block_size: int,
    metrics_collector: KVCacheMetricsCollector | None = None,
    num_prefill_lookahead: int = 0,
    allow_partial_hash_hits: bool = True,
) -> KVCacheCoordinator:
    """Upstream's factory; pooled configs get the pooled coordinators, hybrid
    single-pool configs with prefix caching keep turn-end checkpoints."""
    common = dict(
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        metrics_collector=metrics_collector,
        num_prefill_lookahead=num_prefill_lookahead,
    )
    head = (kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle)
    if isinstance(kv_cache_config, PooledKVCacheConfig):
        if not enable_caching:
            return PooledNoPrefixCacheCoordinator(
                *head, enable_kv_cache_events, **common
            )
        return PooledHybridKVCacheCoordinator(
            *head, enable_caching, enable_kv_cache_events, **common
        )
    factory = upstream_of(__name__, "get_kv_cache_coordinator")
    if (
        enable_caching
        and has_align_state_groups(kv_cache_config)
        and getattr(kv_cache_config, RETAIN_ATTRIBUTE, False)
    ):
        factory = TurnEndHybridKVCacheCoordinator
    return factory(
        *head,
        enable_caching,
        enable_kv_cache_events,
        **common,
        allow_partial_hash_hits=allow_partial_hash_hits,
    )
