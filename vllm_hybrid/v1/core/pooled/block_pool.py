"""One pool of the arena: upstream's ``BlockPool`` over a movable id range.

Each pool indexes its whole view of the arena, so ids stay stable when the
boundary moves, but owns and hands out only the ids the boundary gives it
(:meth:`ArenaBlockPool.resize`), in the order of :mod:`.policy.eviction`.
Prefix-cache events that matter to the other pool are appended, as values,
to a list the coupling gave the pool and handled after the operation; the
pool calls nothing above it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import count

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, KVCacheEvent
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.events import (
    BlocksFreed,
    CacheEvent,
    KeyCached,
    KeysLeftCache,
)
from vllm_hybrid.v1.core.pooled.free_queue import ArenaFreeBlockQueue
from vllm_hybrid.v1.core.pooled.policy.eviction import (
    PLACES,
    STATE_EVICTION_WINDOW,
    Entry,
    Place,
    Reach,
)
from vllm_hybrid.v1.core.pooled.spec import PoolKind

logger = init_logger(__name__)


class ArenaBlockPool(BlockPool):
    """Upstream ``BlockPool`` for one pool of a :class:`~.arena.KVArena`.

    ``blocks`` spans the pool's whole id space, so upstream code indexing
    ``blocks[id]`` or using ``num_gpu_blocks + 1`` as a sentinel keeps
    working; only ``owned_ids`` are ever free or handed out.
    """

    def __init__(
        self,
        side: PoolKind,
        num_ids: int,
        owned_ids: range,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
        medium: str = MEDIUM_GPU,
        events_of: ArenaBlockPool | None = None,
        clock: Iterator[int] | None = None,
    ) -> None:
        self.side = side
        #: the free queue's filing ticks (shared by the arena's two pools)
        self._clock = count() if clock is None else clock
        self._owned_ids = owned_ids
        #: another pool whose KV cache events this one hands out with its own
        self._events_of = events_of
        #: the coupling's list this pool appends its prefix-cache events to
        self.cache_events: list[CacheEvent] | None = None
        #: tokens of attention KV one block holds (``weigh_entries``)
        self._break_even: float | None = None
        #: token ids next to the boundary filed apart (``keep_boundary_clear``)
        self._clear_ids = 0
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
        """This pool's KV cache events; the token pool, which upstream's
        ``KVCacheManager`` reads, also drains the state pool's."""
        events = super().take_events()
        if self._events_of is not None:
            events.extend(self._events_of.take_events())
        return events

    def _new_free_queue(self) -> ArenaFreeBlockQueue:
        queue = ArenaFreeBlockQueue(
            (self.blocks[i] for i in self.owned_ids if self.blocks[i].ref_cnt == 0),
            low_ids_first=self.side is PoolKind.TOKEN,
            window=1 if self.side is PoolKind.TOKEN else STATE_EVICTION_WINDOW,
            clock=self._clock,
        )
        queue.policy.break_even = self._break_even
        queue.hold_clean_from(self._held_from())
        return queue

    def keep_boundary_clear(self, num_ids: int) -> None:
        """File the clean blocks of the ``num_ids`` ids next to the boundary
        apart (token pool only), to hand out after the cached ones while the
        arena refuses requests (:meth:`clear_boundary`)."""
        self._clear_ids = num_ids
        self.free_block_queue.hold_clean_from(self._held_from())

    def clear_boundary(self, clearing: bool) -> None:
        """Hand out the clean blocks next to the boundary last while
        ``clearing`` (:data:`~.policy.eviction.CLEARING_ORDER`)."""
        self.free_block_queue.clearing = clearing

    def _held_from(self) -> int | None:
        if not self._clear_ids or self.side is not PoolKind.TOKEN:
            return None
        return max(self._owned_ids.start, self._owned_ids.stop - self._clear_ids)

    def weigh_entries(self, break_even: float | None) -> None:
        """Weigh this pool's entries against attention KV, of which one of
        its blocks holds ``break_even`` tokens (None: not weighed)."""
        self._break_even = break_even
        self.free_block_queue.policy.break_even = break_even

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Upstream's touch, counting each block's hit for the eviction order."""
        queue = self.free_block_queue
        record_hit = queue.policy.record_hit
        metrics = self.metrics_collector
        for block in blocks:
            if not block.is_null:
                record_hit(block)
                if block.ref_cnt == 0:
                    queue.remove(block)
            block.ref_cnt += 1
            if metrics:
                metrics.on_block_accessed(block)

    @property
    def owned_ids(self) -> range:
        return self._owned_ids

    @property
    def owned_capacity(self) -> int:
        return len(self._owned_ids)

    def get_num_used_blocks(self) -> int:
        return self.owned_capacity - self.get_num_free_blocks()

    def get_num_free_within(self, reach: Reach) -> int:
        """Free blocks an allocation of ``reach`` may take."""
        return self.free_block_queue.num_free_within(reach)

    def get_usage(self) -> float:
        """Used share of the owned blocks (upstream divides by the id space)."""
        if not self.owned_capacity:
            return 0.0
        return self.get_num_used_blocks() / self.owned_capacity

    # -- prefix-cache events the coupling needs ------------------------------

    def move_block_hashes(
        self, src_block: KVCacheBlock, dst_block: KVCacheBlock
    ) -> None:
        """Upstream's re-pointing of a block's entries to its private copy:
        the keys stay cached, so their removal's and insertion's events are
        dropped."""
        recorded = len(self.cache_events) if self.cache_events is not None else 0
        super().move_block_hashes(src_block, dst_block)
        if self.cache_events is not None:
            del self.cache_events[recorded:]

    def _insert_block_hash(
        self,
        block_hash_with_group_id: BlockHashWithGroupId,
        block: KVCacheBlock,
        num_tokens: int | None,
    ) -> None:
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        events = self.cache_events
        # the coupling links state checkpoints to token keys, not the reverse
        if events is not None and num_tokens and self.side is PoolKind.STATE:
            events.append(KeyCached(self.side, block_hash_with_group_id, num_tokens))

    def _remove_cached_block_hashes(
        self, block: KVCacheBlock
    ) -> list[BlockHashWithGroupId]:
        removed = super()._remove_cached_block_hashes(block)
        events = self.cache_events
        if events is not None:
            gone = [
                k
                for k in removed
                if self.cached_block_hash_to_block.get_one_block(k) is None
            ]
            if gone:
                events.append(KeysLeftCache(self.side, gone))
        return removed

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        events = self.cache_events
        if events is not None:
            # upstream routes blocks of another pool there (their own event)
            events.append(BlocksFreed(self.side, [b for b in blocks if b.pool is self]))

    def advance_in_place(self, block: KVCacheBlock) -> list[KVCacheBlock]:
        """``block``, a request's running state block, as its new block: the
        request advances its state in place instead of copying it into a
        fresh one. The block gets a second reference (old and new block table
        slots both name it until upstream frees the old one) and leaves the
        prefix cache, as its content moves on.
        """
        assert block.ref_cnt >= 1 and not block.is_null
        self._maybe_evict_cached_block(block)
        block.ref_cnt += 1
        return [block]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Upstream's allocation as :meth:`take_free`, then :meth:`claim` of
        each block: the pool's handle drives the steps itself, so that the
        coupling settles between blocks. A pool never moves the boundary;
        admission secured the room."""
        blocks = self.take_free(num_blocks)
        for block in blocks:
            self.claim(block)
        return blocks

    def take_free(self, num_blocks: int) -> list[KVCacheBlock]:
        """The first ``num_blocks`` free blocks, all out of the queue before
        any leaves the prefix cache (upstream's order)."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        return blocks

    def claim(self, block: KVCacheBlock) -> None:
        """Hand out a block :meth:`take_free` took: out of the prefix cache,
        with its first reference."""
        if self.enable_caching:
            if (
                block.block_hash is not None
                or block.block_id in self.cached_block_hashes_by_block
            ):
                self._maybe_evict_cached_block(block)
            elif self.metrics_collector:
                # a clean block: upstream's eviction would only do this
                self.metrics_collector.on_block_evicted(block)
        assert block.ref_cnt == 0
        block.ref_cnt += 1
        if self.metrics_collector:
            self.metrics_collector.on_block_allocated(block)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        return bool(self._evict_cached([block]))

    def _evict_cached(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Upstream's eviction of each of ``blocks``; the eviction order
        forgets the blocks that lost their hash, and the free ones among
        them are clean now: re-filed together, to be reused early. Returns
        the blocks that were cached."""
        evict = super()._maybe_evict_cached_block
        forget = self.free_block_queue.policy.forget
        evicted = []
        for block in blocks:
            if evict(block):
                evicted.append(block)
            if block.block_hash is None:
                forget(block)
        self.free_block_queue.refile_n(evicted)
        return evicted

    def evict_cached(self, block: KVCacheBlock) -> bool:
        """Upstream's ``_maybe_evict_cached_block``, public for the pool's
        handle, on which upstream's managers call the private name."""
        return self._maybe_evict_cached_block(block)

    def evict_unwatched(self, blocks: list[KVCacheBlock]) -> None:
        """Evict free cached ``blocks`` as :data:`Entry.DEAD` ranks them, and
        drop their events: nothing links to their keys (:mod:`.coupling`)."""
        assert PLACES[Entry.DEAD] is Place.EVICT
        events = self.cache_events
        recorded = len(events) if events is not None else 0
        self._evict_cached(blocks)
        if events is not None:
            del events[recorded:]

    def rank_entry(
        self, block: KVCacheBlock, entry: Entry, saves: int | None = None
    ) -> None:
        """Put a free cached block where the eviction order files ``entry``,
        with the ``saves`` tokens of recomputation it saves; a block in use
        is left alone."""
        if block.ref_cnt or block.is_null or block.block_hash is None:
            return
        place = self.free_block_queue.policy.rank(block, entry, saves)
        if place is Place.EVICT:
            self._maybe_evict_cached_block(block)
        else:
            self.free_block_queue.place(block, place)

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry if all owned blocks are free
        (upstream compares with ``num_gpu_blocks``, here the id space)."""
        used = self.get_num_used_blocks()
        if used:
            logger.warning(
                "Prefix cache of the %s pool not reset: %d blocks still in use",
                self.side.value,
                used,
            )
            return False
        events = self.cache_events
        keys = self.cached_keys() if events is not None else []
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        # Every free block is clean now, and no hit counts: a fresh queue.
        self.free_block_queue = self._new_free_queue()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        if keys:
            # what these keys meant to the other pool goes, reset or not
            events.append(KeysLeftCache(self.side, keys))
        logger.info("Prefix cache of the %s pool reset", self.side.value)
        return True

    def cached_keys(self) -> list[BlockHashWithGroupId]:
        """Every prefix-cache key this pool holds now."""
        return list(self.cached_block_hash_to_block._cache)

    def blocks_with(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        """Every block holding a prefix-cache key (duplicates included)."""
        held = self.cached_block_hash_to_block._cache.get(key)
        if held is None:
            return []
        if isinstance(held, KVCacheBlock):
            return [held]
        return list(held.values())

    # -- boundary moves ------------------------------------------------------

    def can_move(self, block: KVCacheBlock) -> bool:
        """Whether a live block may change its id (:meth:`swap_ids`): no
        reader of its bytes waits for its reuse by id."""
        return not block.is_null and block.block_id not in self._reuse_watchers

    def swap_ids(self, live: KVCacheBlock, free: KVCacheBlock) -> None:
        """Swap the ids of ``live`` and a free block (:mod:`.moves`): ``free``
        rejoins the queue clean; the keys, hits and metrics of ``live``
        follow it without leaving the cache."""
        assert live.ref_cnt > 0 and free.ref_cnt == 0
        self.free_block_queue.remove(free)
        self._maybe_evict_cached_block(free)
        old, new, num_tokens = live.block_id, free.block_id, live.block_hash_num_tokens
        # the keys move with the block: their events are dropped
        recorded = len(self.cache_events) if self.cache_events is not None else 0
        keys = self._remove_cached_block_hashes(live)
        self.blocks[old], self.blocks[new] = free, live
        live.block_id, free.block_id = new, old
        for i, key in enumerate(keys):  # the token count is the first key's
            self._insert_block_hash(key, live, num_tokens if i == 0 else None)
        if self.cache_events is not None:
            del self.cache_events[recorded:]
        self.free_block_queue.policy.rekey(old, new)
        collector = self.metrics_collector
        if collector is not None and old in collector.block_metrics:
            collector.block_metrics[new] = collector.block_metrics.pop(old)
        self.free_block_queue.append_n([free])

    def resize(
        self, owned_ids: range, settle: Callable[[], None] | None = None
    ) -> None:
        """Own ``owned_ids`` from now on (a boundary move).

        Ids leaving must be free; whoever reads one until its reuse is told.
        Clean ones leave at once; cached ones leave the prefix cache one at a
        time (upstream's ``BlockRemoved`` events), each followed by
        ``settle``, so that the coupling handles what one eviction made dead
        before the next block leaves. Ids arriving come from the other pool,
        clean from this pool's view, and join the free queue.
        """
        blocks, queue = self.blocks, self.free_block_queue
        leaving = [blocks[i] for r in _minus(self._owned_ids, owned_ids) for i in r]
        if self._reuse_watchers:
            self._notify_reuse(leaving)
        clean: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        for block in leaving:
            assert block.ref_cnt == 0, f"block {block.block_id} is in use"
            keyed = block.block_id in self.cached_block_hashes_by_block
            (cached if keyed or block.block_hash is not None else clean).append(block)
        queue.remove_clean(clean)
        for block in cached:
            self._maybe_evict_cached_block(block)
            queue.remove(block)
            if settle is not None:
                settle()
        arriving = [blocks[i] for r in _minus(owned_ids, self._owned_ids) for i in r]
        for block in arriving:
            assert block.ref_cnt == 0 and block.block_hash is None
        self._owned_ids = owned_ids
        queue.append_n(arriving)
        queue.hold_clean_from(self._held_from())


def _minus(ids: range, other: range) -> tuple[range, ...]:
    """The ids of ``ids`` not in ``other``, as at most two ranges, so that a
    boundary move touches only the ids it moves."""
    if not other or other.stop <= ids.start or other.start >= ids.stop:
        return (ids,)
    below = range(ids.start, min(other.start, ids.stop))
    above = range(max(other.stop, ids.start), ids.stop)
    return tuple(r for r in (below, above) if r)
