"""Pooled mode: options, the scope guard, and the KV cache config it produces.

Pooled mode gives a hybrid model one block pool per page kind: a *token* pool
for the attention layers (memory grows with sequence length, natural block
size) and a *state* pool for the O(1) recurrent-state layers (Mamba, Mamba2,
gated DeltaNet, ...), both inside one byte arena per worker. This module holds
the pure parts every process needs to agree on: whether pooled mode applies to
a given ``VllmConfig`` and the :class:`PooledKVCacheConfig` handed to workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.arena import ArenaLayout

logger = init_logger(__name__)

#: Key of this project's options inside ``--additional-config``.
ADDITIONAL_CONFIG_KEY = "hybrid_kv"

#: Every option of the ``hybrid_kv`` object (page unification reads its own).
KNOWN_OPTIONS = frozenset(
    {"pooled", "couple_prefix_caches", "max_page_padding_pct", "max_page_growth"}
)


@dataclass(frozen=True)
class HybridKVOptions:
    """Options read from ``--additional-config '{"hybrid_kv": {...}}'``."""

    #: Use pooled mode for hybrid models (default on).
    pooled: bool = True
    #: Pooled mode with prefix caching: evict attention blocks no cached
    #: state checkpoint needs, and checkpoints whose attention prefix is gone
    #: (default on; off leaves each pool to its own LRU, for A/B runs).
    couple_prefix_caches: bool = True

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> HybridKVOptions:
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(ADDITIONAL_CONFIG_KEY, {}) if isinstance(extra, dict) else {}
        if not isinstance(raw, dict):
            raise ValueError(
                f"--additional-config {ADDITIONAL_CONFIG_KEY!r} must be a JSON "
                f'object, e.g. \'{{"{ADDITIONAL_CONFIG_KEY}": {{"pooled": false}}}}\''
            )
        unknown = sorted(set(raw) - KNOWN_OPTIONS)
        if unknown:
            raise ValueError(
                f"Unknown --additional-config {ADDITIONAL_CONFIG_KEY} option(s) "
                f"{unknown}; known options: {sorted(KNOWN_OPTIONS)}"
            )
        flags = {
            name: raw.get(name, True) for name in ("pooled", "couple_prefix_caches")
        }
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(
                    f"--additional-config {ADDITIONAL_CONFIG_KEY}.{name} must be "
                    f"true or false, got {value!r}"
                )
        return cls(**flags)


@dataclass(frozen=True)
class PooledDecision:
    """Whether pooled mode applies, and if not, why (for the one log line)."""

    enabled: bool
    reason: str


def _unsupported_feature(vllm_config: Any) -> str | None:
    """The first feature pooled mode does not support yet, or None."""
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    checks: list[tuple[bool, str]] = [
        (vllm_config.kv_transfer_config is not None, "KV connectors/transfer"),
        (
            getattr(vllm_config.attention_config, "hisparse_config", None) is not None,
            "HiSparse",
        ),
        (
            getattr(parallel, "decode_context_parallel_size", 1) > 1,
            "decode context parallel",
        ),
        (
            getattr(parallel, "prefill_context_parallel_size", 1) > 1,
            "prefill context parallel",
        ),
        (parallel.pipeline_parallel_size > 1, "pipeline parallel"),
        (vllm_config.speculative_config is not None, "speculative decoding"),
        (bool(getattr(cache, "kv_cache_dtype_skip_layers", None)), "skip layers"),
        (cache.num_gpu_blocks_override is not None, "num_gpu_blocks_override"),
        (_v2_runner_forced(), "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)"),
    ]
    for unsupported, name in checks:
        if unsupported:
            return name
    return None


def _v2_runner_forced() -> bool:
    import vllm.envs as envs

    return envs.VLLM_USE_V2_MODEL_RUNNER is True


_logged_fallbacks: set[str] = set()


def pooled_mode_decision(vllm_config: Any) -> PooledDecision:
    """Decide pooled mode for this config; identical in every process.

    Non-hybrid models are never pooled (they keep upstream's plan exactly).
    For hybrid models a feature pooled mode does not support yet makes the
    engine use upstream's single pool, with one log line naming the feature.
    """
    model_config = vllm_config.model_config
    if model_config is None or not getattr(model_config, "is_hybrid", False):
        return PooledDecision(False, "not a hybrid model")
    options = HybridKVOptions.from_vllm_config(vllm_config)
    if not options.pooled:
        return PooledDecision(False, "disabled by --additional-config")
    feature = _unsupported_feature(vllm_config)
    if feature is not None:
        if feature not in _logged_fallbacks:
            _logged_fallbacks.add(feature)
            logger.info(
                "vllm-hybrid pooled KV mode does not support %s yet; using "
                "upstream's single shared KV pool for this engine",
                feature,
            )
        return PooledDecision(False, f"unsupported: {feature}")
    return PooledDecision(True, "hybrid model")


@dataclass(frozen=True)
class KVPoolSpec:
    """One block pool of the arena, as every process sees it."""

    #: "token" (grows with sequence length) or "state" (O(1) per request).
    kind: str
    #: KV cache group ids served by this pool.
    group_ids: tuple[int, ...]
    #: Bytes of one block id (one page of every layer of its groups).
    block_bytes: int
    #: Size of the pool's block-id space (its view over the whole arena).
    num_blocks: int


@dataclass
class PooledKVCacheConfig(KVCacheConfig):
    """A ``KVCacheConfig`` whose groups live in separate pools of one arena.

    ``num_blocks`` keeps meaning the token pool's id space for upstream code
    that reads it (zeroing, logs, watermark); per-pool sizes are in ``pools``.
    Being a dataclass subclass, it survives deepcopy and pickling to workers.
    """

    pools: list[KVPoolSpec] = field(default_factory=list)
    #: Geometry of the arena (block sizes, floors, initial boundary, null
    #: blocks); the scheduler's KVArena is built from exactly this.
    arena: ArenaLayout | None = None
    #: State blocks one running request holds at most (for capacity figures).
    state_blocks_per_request: int = 1
    #: Couple the pools' prefix-cache eviction (see prefix_cache_view).
    couple_prefix_caches: bool = True

    @property
    def layout(self) -> ArenaLayout:
        assert self.arena is not None, "pooled config without an arena layout"
        return self.arena

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena (the single backing allocation per worker)."""
        return self.layout.arena_bytes

    @property
    def null_region_bytes(self) -> int:
        return self.layout.null_region_bytes

    @property
    def null_blocks_overlap(self) -> bool:
        return self.layout.null_blocks_overlap

    @property
    def initial_boundary(self) -> int:
        """Initial token/state boundary in bytes."""
        layout = self.layout
        return layout.state_offset + layout.initial_state_floor * (
            layout.state_block_bytes
        )

    def pool_of_group(self, group_id: int) -> KVPoolSpec:
        for pool in self.pools:
            if group_id in pool.group_ids:
                return pool
        raise KeyError(f"KV cache group {group_id} is in no pool")

    def pool_by_kind(self, kind: str) -> KVPoolSpec:
        for pool in self.pools:
            if pool.kind == kind:
                return pool
        raise KeyError(f"no {kind} pool")

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks of the pool whose view ``tensor`` is (workers allocate with
        this); logs the worker's view of the arena once per process."""
        layer = tensor.layers[0]
        for group_id, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_names:
                logger.info_once(
                    "vllm-hybrid pooled KV arena on this worker: %s",
                    self.describe_pools(),
                )
                return self.pool_of_group(group_id).num_blocks
        raise KeyError(f"layer {layer} is in no KV cache group")

    def describe_pools(self) -> str:
        return (
            "; ".join(
                f"{pool.kind} pool {pool.num_blocks} ids x {pool.block_bytes} B"
                for pool in self.pools
            )
            + f"; arena {self.arena_bytes} B"
        )
