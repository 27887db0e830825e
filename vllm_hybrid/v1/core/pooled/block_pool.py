"""One pool of the arena: upstream's ``BlockPool`` over a movable id range.

Each pool indexes its whole view of the arena (ids stay stable when the
boundary moves) but owns, frees and hands out only the ids the arena gives it
(:attr:`ArenaBlockPool.owned_ids`). Prefix-cache events that matter to the
other pool are reported to the arena's :class:`~.coupling.PrefixCacheCoupling`
when coupling is on; the pool itself knows nothing of the other pool's rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, KVCacheEvent
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.free_queue import ArenaFreeBlockQueue
from vllm_hybrid.v1.core.pooled.spec import PoolKind

logger = init_logger(__name__)

#: Prefix hits after which a cached block joins its free queue's protected
#: segment (handed out last; see :class:`ArenaFreeBlockQueue`). One hit can
#: be chance (a retried request); two mean the entry is shared or followed up.
PROTECT_AFTER_HITS = 2


class ArenaBlockPool(BlockPool):
    """Upstream ``BlockPool`` for one pool of a :class:`~.arena.KVArena`.

    ``blocks`` spans the pool's whole id space (``num_gpu_blocks`` = NT or NS),
    so ids are stable across boundary moves and upstream code indexing
    ``blocks[id]`` or using ``num_gpu_blocks + 1`` as a sentinel keeps working;
    only the ids in ``owned_ids`` are ever in the free queue or handed out.
    """

    def __init__(
        self,
        arena: Any,
        side: PoolKind,
        num_ids: int,
        owned_ids: range,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
        medium: str = MEDIUM_GPU,
    ) -> None:
        self.arena = arena
        self.side = side
        self.owned_ids = owned_ids
        #: block the next one-block allocation returns (see lend_in_place)
        self._lent: KVCacheBlock | None = None
        #: request whose blocks are being cached (state side: links them)
        self._caching: Any = None
        #: keys are being re-pointed to another block, not leaving the cache
        self._moving = False
        #: prefix hits per cached block id since it was cached
        self._hits: dict[int, int] = {}
        # Upstream builds its linked-list queue over every id and pops id 0 as
        # the null block; keep all of that, then swap in the arena's queue.
        super().__init__(
            num_ids,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
            medium=medium,
        )
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = self._new_free_queue()

    def take_events(self) -> list[KVCacheEvent]:
        """This pool's KV cache events; the token pool also drains the state
        pool's, because upstream's ``KVCacheManager`` reads events from one
        pool (its ``block_pool``, the token pool). Events keep their group
        index, so consumers still see which pool a block belongs to."""
        events = super().take_events()
        if self.side is PoolKind.TOKEN:
            events.extend(self.arena.state_pool.take_events())
        return events

    def _new_free_queue(self) -> ArenaFreeBlockQueue:
        return ArenaFreeBlockQueue(
            (self.blocks[i] for i in self.owned_ids if self.blocks[i].ref_cnt == 0),
            low_ids_first=self.side is PoolKind.TOKEN,
            protected=self.is_proven,
        )

    def is_proven(self, block: KVCacheBlock) -> bool:
        """Whether a cached block served :data:`PROTECT_AFTER_HITS` prefix
        hits since it was cached."""
        return self._hits.get(block.block_id, 0) >= PROTECT_AFTER_HITS

    def hit_counts(self) -> dict[int, int]:
        """Prefix hits per cached block id since it was cached (a copy)."""
        return dict(self._hits)

    def touch(self, blocks: Any) -> None:
        """Upstream's touch (a prefix hit takes a reference), counting the
        hit of every cached block."""
        for block in blocks:
            if block.block_hash is not None and not block.is_null:
                self._hits[block.block_id] = self._hits.get(block.block_id, 0) + 1
        super().touch(blocks)

    @property
    def owned_capacity(self) -> int:
        """Blocks this pool owns now (null and reserved ids never count)."""
        return len(self.owned_ids)

    def get_num_used_blocks(self) -> int:
        return self.owned_capacity - self.get_num_free_blocks()

    def get_usage(self) -> float:
        """Used share of the owned blocks (upstream divides by the id space)."""
        if not self.owned_capacity:
            return 0.0
        return self.get_num_used_blocks() / self.owned_capacity

    # -- prefix-cache events the coupling needs (see .coupling) --------------

    def cache_full_blocks(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self._caching = request
        try:
            super().cache_full_blocks(request, *args, **kwargs)
        finally:
            self._caching = None

    def cache_partial_block(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._caching = request
        try:
            return super().cache_partial_block(request, *args, **kwargs)
        finally:
            self._caching = None

    def move_block_hashes(
        self, src_block: KVCacheBlock, dst_block: KVCacheBlock
    ) -> None:
        self._moving = True
        try:
            super().move_block_hashes(src_block, dst_block)
        finally:
            self._moving = False

    def _insert_block_hash(
        self, block_hash_with_group_id: Any, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        coupling = self.arena.coupling
        if coupling is not None and self._caching is not None and num_tokens:
            coupling.key_cached(
                self.side, block_hash_with_group_id, self._caching, num_tokens
            )

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[Any]:
        removed = super()._remove_cached_block_hashes(block)
        coupling = self.arena.coupling
        if coupling is not None and not self._moving:
            gone = [
                k
                for k in removed
                if self.cached_block_hash_to_block.get_one_block(k) is None
            ]
            if gone:
                coupling.keys_left_cache(self.side, gone)
        return removed

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        coupling = self.arena.coupling
        if coupling is not None:
            # upstream routes blocks of another pool there (their own check)
            coupling.evict_dead(self.side, (b for b in blocks if b.pool is self))

    def lend_in_place(self, block: KVCacheBlock | None) -> None:
        """Make the next one-block allocation return ``block`` itself.

        Used when memory is short and a request advances its recurrent state
        in the block it already owns instead of copying it into a fresh one:
        the block gets a second reference (the request's old and new block
        table slots both name it; upstream frees the old slot next step) and
        leaves the prefix cache, because its content moves on.
        """
        self._lent = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Upstream's allocation, after asking the arena to move the boundary
        in this pool's favour when it is short (may still raise ValueError)."""
        lent, self._lent = self._lent, None
        if lent is not None and num_blocks == 1:
            assert lent.ref_cnt >= 1 and not lent.is_null
            self._maybe_evict_cached_block(lent)
            lent.ref_cnt += 1
            return [lent]
        if num_blocks > self.get_num_free_blocks():
            self.arena.ensure_side(self.side, num_blocks)
        return super().get_new_blocks(num_blocks)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        evicted = super()._maybe_evict_cached_block(block)
        if block.block_hash is None:
            self._hits.pop(block.block_id, None)
        if evicted:
            # A free block that lost its hash is clean now: reuse it early.
            self.free_block_queue.refile(block)
        return evicted

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry if all owned blocks are free.

        Upstream compares against ``num_gpu_blocks``, which here is the id
        space, not what the pool owns, so the check and the body are redone.
        """
        used = self.get_num_used_blocks()
        if used:
            logger.warning(
                "Prefix cache of the %s pool not reset: %d blocks still in use",
                self.side.value,
                used,
            )
            return False
        self._clear_prefix_cache()
        return True

    def cached_keys(self) -> list[Any]:
        """Every prefix-cache key this pool holds now."""
        return list(self.cached_block_hash_to_block._cache)

    def blocks_with(self, key: Any) -> list[KVCacheBlock]:
        """Every block holding a prefix-cache key (duplicates included)."""
        held = self.cached_block_hash_to_block._cache.get(key)
        if held is None:
            return []
        if isinstance(held, KVCacheBlock):
            return [held]
        return list(held.values())

    def evict_free(self, block: KVCacheBlock) -> None:
        """Drop a free block's prefix-cache entries (it is reused first)."""
        self._maybe_evict_cached_block(block)

    def _clear_prefix_cache(self) -> None:
        coupling = self.arena.coupling
        keys = self.cached_keys() if coupling is not None else []
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        self._hits.clear()
        # Every free block is clean now: rebuild rather than re-file one by one.
        self.free_block_queue = self._new_free_queue()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        if keys:
            # The other pool may have been reset too, or be busy: drop what
            # this pool's keys meant to it either way.
            coupling.keys_left_cache(self.side, keys)
        logger.info("Prefix cache of the %s pool reset", self.side.value)

    # -- boundary moves (called by the arena only) -------------------------

    def _give_away(self, ids: range) -> None:
        """Drop free owned ``ids`` from this pool; cached ones are evicted."""
        blocks = [self.blocks[i] for i in ids]
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} is in use"
            self._maybe_evict_cached_block(block)
            self.free_block_queue.remove(block)

    def _take_over(self, ids: range) -> None:
        """Add never-used (from this pool's view) ``ids`` as clean free blocks."""
        blocks = [self.blocks[i] for i in ids]
        for block in blocks:
            assert block.ref_cnt == 0 and block.block_hash is None
        self.free_block_queue.append_n(blocks)
