"""Coordinators for pooled mode: one arena, a token pool and a state pool.

Upstream's coordinators build one ``BlockPool`` and hand it to every group's
manager. The pooled coordinators let upstream build everything, then bind each
manager to the pool of its page kind from a :class:`KVArena`, and admit
requests across both pools: :meth:`PooledCoordinatorMixin.admit` decides
(:mod:`.admission`) and :meth:`PooledCoordinatorMixin.allocate` carries out.

``KVCacheManager`` keeps reading ``coordinator.block_pool``; it is the token
pool, so usage, watermark and "free blocks" keep their upstream meaning for
the memory that grows with sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
)
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.admission import Admission, Admitter, KeepsEdge
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.policy.positions import (
    DECODE_EDGES,
    CheckpointPolicy,
    state_block_attention_tokens,
)
from vllm_hybrid.v1.core.pooled.retention import TurnEndRetentionMixin
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

logger = init_logger(__name__)


class PooledCoordinatorMixin:
    """Binds managers to arena pools and admits requests across both pools."""

    kv_cache_config: PooledKVCacheConfig
    single_type_managers: tuple[SingleTypeKVCacheManager, ...]

    def _bind_arena(self, keeps_edge: KeepsEdge | None) -> None:
        # no encoder blocks in the arena (checked once: the managers are fixed)
        assert not any(
            isinstance(m, CrossAttentionManager) for m in self.single_type_managers
        )
        upstream_pool = self.block_pool  # built by upstream; only settings kept
        self.arena = KVArena(
            self.kv_cache_config.layout,
            enable_caching=upstream_pool.enable_caching,
            hash_block_size=upstream_pool.hash_block_size,
            enable_kv_cache_events=upstream_pool.enable_kv_cache_events,
            token_metrics_collector=upstream_pool.metrics_collector,
            break_even=state_block_attention_tokens(self.kv_cache_config),
        )
        pools = {
            PoolKind.TOKEN: self.arena.token_pool,
            PoolKind.STATE: self.arena.state_pool,
        }
        kinds = [
            self.kv_cache_config.pool_of_group(i).kind
            for i in range(len(self.single_type_managers))
        ]
        # Upstream's managers hold the one pool their coordinator built;
        # point each at its arena pool (registry: INSTANCE_REWRITES).
        for manager, kind in zip(self.single_type_managers, kinds, strict=True):
            manager.block_pool = pools[kind]
            manager._null_block = pools[kind].null_block
        self.block_pool = self.arena.token_pool
        self._couple_prefix_caches(kinds)
        self.admitter = Admitter(
            self.arena, self.single_type_managers, kinds, keeps_edge
        )
        #: how often each short-of-memory way served an allocation
        self.short_memory_counts = {
            "state_in_place": 0,
            "edges_in_place": 0,
            "relocations": 0,
        }

    def _couple_prefix_caches(self, kinds: Sequence[PoolKind]) -> None:
        """Coordinated eviction across the pools (:mod:`.coupling`), when
        prefix caching is on and the token pool's groups are full attention
        (a sliding window needs only its tail blocks for a hit)."""
        config = self.kv_cache_config
        if not self.arena.token_pool.enable_caching:
            return
        token_groups: dict[int, int] = {}
        for group_id, kind in enumerate(kinds):
            spec = config.kv_cache_groups[group_id].kv_cache_spec
            if kind is not PoolKind.TOKEN:
                continue
            if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
                return
            token_groups[group_id] = spec.block_size
        if token_groups and PoolKind.STATE in kinds:
            self.arena.couple_prefix_caches(token_groups)

    def admit(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
        reserve: int = 0,
    ) -> Admission | None:
        """How the arena serves the request's next allocation (upstream's
        ``get_num_blocks_to_allocate`` arguments, and the ``reserve`` of
        token blocks a waiting request leaves free); None when it cannot."""
        if self.retention_interval != 0:
            prefill_end = 0
        needs = [
            manager.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks[i],
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                prefill_end=prefill_end,
            )
            for i, manager in enumerate(self.single_type_managers)
        ]
        hits = [block for blocks in new_computed_blocks for block in blocks]
        return self.admitter.admit(
            request_id, needs, hits, total_computed_tokens, reserve
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Token-pool blocks the allocation takes from those free now
        (:meth:`admit`); one more than are free when it cannot serve the
        request, so that upstream's "cannot allocate" path runs."""
        admission = self.admit(
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        )
        if admission is None:
            return self.block_pool.get_num_free_blocks() + 1
        return admission.token_blocks_taken

    def allocate(
        self,
        admission: Admission,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Carry out ``admission``: the boundary's move, then upstream's
        allocation, through an :class:`InPlaceView` for a state group that
        advances in place."""
        self.arena.boundary.carry_out(admission.boundary)
        if admission.way is not None:
            self.short_memory_counts[admission.way.value] += 1
        if not admission.in_place:
            return self.allocate_new_blocks(
                request_id, num_tokens, num_tokens_main_model, num_encoder_tokens
            )
        out = []
        for i, manager in enumerate(self.single_type_managers):
            pool = manager.block_pool
            if i in admission.in_place:
                manager.block_pool = InPlaceView(pool, admission.in_place[i])
            try:
                out.append(
                    manager.allocate_new_blocks(
                        request_id, num_tokens, num_tokens_main_model
                    )
                )
            finally:
                manager.block_pool = pool
        return tuple(out)


class InPlaceView:
    """The state pool as one manager's allocation sees it when its request
    advances in place: a one-block allocation returns the running block
    (:meth:`ArenaBlockPool.advance_in_place`), so the block travels down as
    a value; anything else is the pool's.
    """

    def __init__(self, pool: ArenaBlockPool, block: KVCacheBlock) -> None:
        self.pool = pool
        self.block = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks == 1:
            return self.pool.advance_in_place(self.block)
        return self.pool.get_new_blocks(num_blocks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def arena_of(kv_cache_manager: KVCacheManager) -> KVArena | None:
    """The arena behind a scheduler's KV cache manager; None with
    upstream's coordinators."""
    return getattr(kv_cache_manager.coordinator, "arena", None)


class PooledHybridKVCacheCoordinator(
    PooledCoordinatorMixin, TurnEndRetentionMixin, HybridKVCacheCoordinator
):
    """Prefix caching on: upstream's hybrid coordinator over arena pools,
    keeping turn-end checkpoints (:mod:`vllm_hybrid.v1.core.pooled.retention`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Partial (sub-block) hits need copy-on-write block copies, which the
        # worker applies with one block count for every layer; pools differ.
        kwargs["allow_partial_hash_hits"] = False
        super().__init__(*args, **kwargs)
        self._bind_arena(self.keeps_edge)
        # upstream grouped the managers by the one pool they shared
        self.verify_and_split_kv_cache_groups()
        config = self.kv_cache_config
        self._init_turn_ends(
            CheckpointPolicy.of(
                config.retain_turn_ends,
                config.prefill_checkpoint_interval,
                config.prefill_checkpoint_anchor,
                DECODE_EDGES,
            )
        )


class PooledNoPrefixCacheCoordinator(
    PooledCoordinatorMixin, KVCacheCoordinatorNoPrefixCache
):
    """Prefix caching off: upstream's no-cache coordinator over arena pools."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bind_arena(None)
