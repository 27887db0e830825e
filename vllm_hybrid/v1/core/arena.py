"""Scheduler-side bookkeeping of pooled mode: two block pools in one byte arena.

Pooled mode (issue 3) gives a hybrid model one ``BlockPool`` per page kind
instead of upstream's single pool with one page size:

* the *token* pool serves the attention groups at their natural page size;
* the *state* pool serves the recurrent-state groups (Mamba, GDN, ...); one
  state block holds one request's state for every state layer.

Both pools live in one device allocation of ``T`` bytes, and both pools' tensor
views start at byte 0 of it: token block ``t`` covers ``[t*tb, (t+1)*tb)`` and
state block ``s`` covers ``[s*sb, (s+1)*sb)``. Block ids are pool-local and id
0 of each pool is that pool's null block. Bytes ``[0, R)`` with
``R = max(tb, sb)`` form the shared null region, so the ids of either pool
that touch it (besides 0) are *reserved*: never owned, never handed out.

Ownership is a function of one number, the *state floor* ``s_floor``: the
state pool owns ids ``[s_floor, NS)`` and the token pool owns every whole token
block between the null region and the state floor, ``[t_first, t_limit)`` with
``t_limit = s_floor * sb // tb``. The *boundary* is ``s_floor * sb`` bytes, so
no byte is ever owned by both pools (``t_limit * tb <= s_floor * sb``); the
slack between the two, if any, is smaller than one token block.

Allocation order
    Each pool's free queue (:class:`ArenaFreeBlockQueue`) hands out blocks
    without a prefix-cache hash first, farthest from the boundary first (token:
    lowest id; state: highest id), and only then evictable cached blocks in LRU
    order, as upstream does. A block next to the boundary is therefore only
    handed out once its pool has no clean block left, which keeps the boundary
    movable most of the time.

When the boundary moves (policy)
    Only on demand, in :meth:`KVArena.ensure`, which the scheduler calls before
    allocating (and which :meth:`ArenaBlockPool.get_new_blocks` calls itself
    when short, for its own side). A move happens only when one pool lacks free
    blocks for the request at hand, moves by the smallest whole number of state
    blocks that covers the deficit, and never rebalances in advance. The ids of
    the shrinking pool that lie in the way must all be free; cached ones among
    them are evicted first (``BlockRemoved`` events are emitted by the usual
    eviction path). The move is all-or-nothing: either every condition holds
    and the boundary moves, or nothing changes. Live blocks are never moved
    (migration by copy is a possible later optimisation).

Worst case
    A long-lived block at the boundary (the state block at ``s_floor`` or the
    token block at ``t_limit - 1``) pins it: the other pool cannot grow past it
    until that block is freed, and :meth:`KVArena.ensure` returns False, so the
    scheduler must preempt or wait as it would with a static split. The damage
    is bounded by the floors: the boundary never moves so that the token pool
    owns fewer than ``min_token_blocks`` or the state pool fewer than
    ``min_state_blocks`` blocks, so a pinned arena still behaves at least like
    a static split with those floors (choose them as one ``max_model_len``
    request's token blocks and ``max_num_seqs`` requests' state blocks). Since
    boundary blocks are handed out last, a pin needs the pinned pool to have
    been full of live or cached blocks when the pinning block was allocated.

Bytes handed from one pool to the other keep the losing pool's contents;
:meth:`KVArena.take_boundary_moves` lists the gained ids so the caller can
zero them where the receiving kernels expect zeros.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, KVCacheEvent
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_group_id

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.prefix_cache_view import CheckpointLinks

logger = init_logger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ArenaSide(str, Enum):
    """Which end of the arena a pool lives at."""

    TOKEN = "token"
    STATE = "state"


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


def null_region_bytes(token_block: int, state_block: int, overlap: bool) -> int:
    """Bytes at the arena's start that no owned block may use (see
    :attr:`ArenaLayout.null_region_bytes`)."""
    return min(token_block, state_block) if overlap else max(token_block, state_block)


@dataclass(frozen=True)
class ArenaLayout:
    """Byte geometry of the arena and the limits the boundary must respect.

    All sizes are in bytes; the minimums are in blocks of the respective pool.
    ``initial_boundary`` is rounded down to a state block edge (so the state
    pool gets a partially covered block), and up to the end of the null region.
    """

    arena_bytes: int
    token_block_bytes: int
    state_block_bytes: int
    min_token_blocks: int
    min_state_blocks: int
    initial_boundary: int
    #: Let each pool's null block overlap blocks the other pool owns. Only
    #: sound where nothing ever writes through a null block id: upstream
    #: writes padded state slots to state id 0 under full CUDA graphs, so the
    #: planner enables this only without them (e.g. on CPU).
    null_blocks_overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("arena_bytes", "token_block_bytes", "state_block_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ArenaLayout.{name} must be positive")
        for name in ("min_token_blocks", "min_state_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"ArenaLayout.{name} must not be negative")
        if self.null_region_bytes >= self.arena_bytes:
            raise ValueError(
                f"Arena of {self.arena_bytes} B is too small: the null region "
                f"alone takes {self.null_region_bytes} B "
                f"(max of token block {self.token_block_bytes} B and state block "
                f"{self.state_block_bytes} B)"
            )
        lo, hi = self.min_state_floor, self.max_state_floor
        if lo > hi:
            raise ValueError(
                f"Arena of {self.arena_bytes} B cannot hold the minimums of "
                f"{self.min_token_blocks} token blocks of {self.token_block_bytes} "
                f"B and {self.min_state_blocks} state blocks of "
                f"{self.state_block_bytes} B next to the null region of "
                f"{self.null_region_bytes} B (token pool at most "
                f"{self.token_capacity_at(hi)} blocks at the highest possible "
                f"boundary {hi * self.state_block_bytes} B)"
            )
        s_floor = self.initial_state_floor
        if not lo <= s_floor <= hi:
            raise ValueError(
                f"Initial boundary {self.initial_boundary} B (state floor id "
                f"{s_floor}) violates the minimums of {self.min_token_blocks} "
                f"token and {self.min_state_blocks} state blocks; it must lie in "
                f"[{lo * self.state_block_bytes}, "
                f"{(hi + 1) * self.state_block_bytes}) B"
            )

    # -- id spaces ------------------------------------------------------

    @property
    def num_token_ids(self) -> int:
        """NT: size of the token pool's id space (its view over the arena)."""
        return self.arena_bytes // self.token_block_bytes

    @property
    def num_state_ids(self) -> int:
        """NS: size of the state pool's id space (its view over the arena)."""
        return self.arena_bytes // self.state_block_bytes

    @property
    def null_region_bytes(self) -> int:
        """R: bytes ``[0, R)`` no owned block may use.

        ``max(tb, sb)`` keeps both null blocks clear of owned blocks;
        with ``null_blocks_overlap`` only the smaller one is kept clear, so
        both pools start at id 1.
        """
        return null_region_bytes(
            self.token_block_bytes, self.state_block_bytes, self.null_blocks_overlap
        )

    @property
    def first_token_id(self) -> int:
        """Lowest token id clear of the null region."""
        return _cdiv(self.null_region_bytes, self.token_block_bytes)

    @property
    def state_offset(self) -> int:
        """Byte where the state pool's view (its id 0) starts.

        With overlapping null blocks the state view is aligned to the top of
        the arena, so the highest state id ends exactly at its last byte and
        no tail smaller than a state block is lost; otherwise it starts at 0
        and both null blocks sit in ``[0, R)``.
        """
        if self.null_blocks_overlap:
            return self.arena_bytes % self.state_block_bytes
        return 0

    @property
    def first_state_id(self) -> int:
        """Lowest state id clear of the null region."""
        clear = max(0, self.null_region_bytes - self.state_offset)
        return max(1, _cdiv(clear, self.state_block_bytes))

    @property
    def reserved_token_ids(self) -> range:
        """Token ids overlapping the null region, other than the null block."""
        return range(1, self.first_token_id)

    @property
    def reserved_state_ids(self) -> range:
        """State ids overlapping the null region, other than the null block."""
        return range(1, self.first_state_id)

    # -- ownership as a function of the state floor ----------------------

    def token_limit_at(self, state_floor: int) -> int:
        """End (exclusive) of the token ids owned when the state pool starts at
        ``state_floor``; may be below ``first_token_id`` (no token blocks)."""
        start = self.state_offset + state_floor * self.state_block_bytes
        return start // self.token_block_bytes

    def token_ids_at(self, state_floor: int) -> range:
        return range(self.first_token_id, self.token_limit_at(state_floor))

    def state_ids_at(self, state_floor: int) -> range:
        return range(state_floor, self.num_state_ids)

    def token_capacity_at(self, state_floor: int) -> int:
        return len(self.token_ids_at(state_floor))

    def state_capacity_at(self, state_floor: int) -> int:
        return len(self.state_ids_at(state_floor))

    def state_floor_for_token_capacity(self, capacity: int) -> int:
        """Lowest state floor that leaves ``capacity`` token blocks."""
        if capacity <= 0:
            return self.first_state_id
        end = (self.first_token_id + capacity) * self.token_block_bytes
        above = max(0, end - self.state_offset)
        return max(self.first_state_id, _cdiv(above, self.state_block_bytes))

    @property
    def min_state_floor(self) -> int:
        """Lowest state floor: the token pool keeps ``min_token_blocks``."""
        return self.state_floor_for_token_capacity(self.min_token_blocks)

    @property
    def max_state_floor(self) -> int:
        """Highest state floor: the state pool keeps ``min_state_blocks``."""
        return self.num_state_ids - self.min_state_blocks

    @property
    def initial_state_floor(self) -> int:
        above = max(0, self.initial_boundary - self.state_offset)
        return max(self.first_state_id, above // self.state_block_bytes)


# ---------------------------------------------------------------------------
# Free queue
# ---------------------------------------------------------------------------


class ArenaFreeBlockQueue:
    """Free blocks of one arena pool, in the order the arena wants them reused.

    Same interface as upstream's ``FreeKVCacheBlockQueue`` as ``BlockPool`` and
    the simple KV offloader use it, different order:

    1. *clean* blocks (no prefix-cache hash) first, farthest from the boundary
       first: a min-heap of ids (token side) or of negated ids (state side) with
       lazy deletion, so every operation is O(log n) amortised;
    2. then *cached* blocks (hash set), least recently freed first. Upstream's
       ``append_n`` puts them at the LRU tail and ``prepend_n`` at the head,
       in the given order; both are kept.

    A block is filed by its hash when it enters the queue; :meth:`refile` moves
    it when its hash changes while free (eviction by id, cache reset). The
    ``prev_free_block``/``next_free_block`` links of blocks are not used.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock], low_ids_first: bool) -> None:
        self.low_ids_first = low_ids_first
        self._clean: dict[int, KVCacheBlock] = {}
        self._heap: list[int] = []
        self._cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.append_n(list(blocks))

    # -- read side --------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._cached)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        bid = block.block_id
        return self._clean.get(bid) is block or self._cached.get(bid) is block

    def clean_ids(self) -> list[int]:
        """Ids of clean free blocks, in hand-out order."""
        return sorted(self._clean, reverse=not self.low_ids_first)

    def cached_ids(self) -> list[int]:
        """Ids of cached free blocks, in LRU (hand-out) order."""
        return list(self._cached)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in the order ``popleft`` would return them."""
        clean = [self._clean[bid] for bid in self.clean_ids()]
        return clean + list(self._cached.values())

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in hand-out order after ``cursor`` (from the start if
        None; nothing if ``cursor`` is no longer free, like upstream's list).
        O(n): only the simple KV offloader walks the queue this way."""
        blocks = self.get_all_free_blocks()
        if cursor is None:
            yield from blocks
            return
        if cursor not in self:
            return
        position = next(i for i, b in enumerate(blocks) if b is cursor)
        yield from blocks[position + 1 :]

    # -- write side -------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        while self._heap:
            bid = self._key_to_id(heapq.heappop(self._heap))
            block = self._clean.pop(bid, None)
            if block is not None:
                return block
        if self._cached:
            return self._cached.popitem(last=False)[1]
        raise ValueError("No free blocks available in the arena pool")

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(
                f"Cannot pop {n} blocks from a queue of {self.num_free_blocks}"
            )
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if self._clean.get(bid) is block:
            del self._clean[bid]  # its heap entry goes stale
            self._maybe_compact()
        elif self._cached.get(bid) is block:
            del self._cached[bid]
        else:
            raise RuntimeError(f"remove() of block {bid}, which is not free")

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self._check_absent(block)
            if block.block_hash is None:
                self._push_clean(block)
            else:
                self._cached[block.block_id] = block

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        cached = []
        for block in blocks:
            self._check_absent(block)
            if block.block_hash is None:
                self._push_clean(block)
            else:
                cached.append(block)
        # Put the cached ones at the LRU head, first given first.
        for block in reversed(cached):
            self._cached[block.block_id] = block
            self._cached.move_to_end(block.block_id, last=False)

    def refile(self, block: KVCacheBlock) -> None:
        """Re-file a free block whose hash changed; no-op if not free."""
        bid = block.block_id
        if block.block_hash is None and self._cached.get(bid) is block:
            del self._cached[bid]
            self._push_clean(block)
        elif block.block_hash is not None and self._clean.get(bid) is block:
            del self._clean[bid]
            self._cached[bid] = block

    # -- helpers ----------------------------------------------------------

    def _id_to_key(self, bid: int) -> int:
        return bid if self.low_ids_first else -bid

    _key_to_id = _id_to_key  # negation is its own inverse

    def _push_clean(self, block: KVCacheBlock) -> None:
        self._clean[block.block_id] = block
        heapq.heappush(self._heap, self._id_to_key(block.block_id))

    def _check_absent(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if bid in self._clean or bid in self._cached:
            raise RuntimeError(f"block {bid} is already in the free queue")

    def _maybe_compact(self) -> None:
        """Drop stale heap entries once they outnumber live ones, so the heap
        stays O(free blocks) however many removals happen."""
        if len(self._heap) > 2 * len(self._clean) + 64:
            self._heap = [self._id_to_key(bid) for bid in self._clean]
            heapq.heapify(self._heap)


# ---------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------


class ArenaBlockPool(BlockPool):
    """Upstream ``BlockPool`` for one side of a :class:`KVArena`.

    ``blocks`` spans the side's whole id space (``num_gpu_blocks`` = NT or NS),
    so ids are stable across boundary moves and upstream code indexing
    ``blocks[id]`` or using ``num_gpu_blocks + 1`` as a sentinel keeps working;
    only the ids in ``owned_ids`` are ever in the free queue or handed out.
    """

    def __init__(
        self,
        arena: KVArena,
        side: ArenaSide,
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
        #: Called whenever the scheduler reads this pool's usage (set by the
        #: coordinator to publish per-pool metrics).
        self.on_usage: Callable[[], object] | None = None
        #: block the next one-block allocation returns (see lend_in_place)
        self._lent: KVCacheBlock | None = None
        #: request whose blocks are being cached (state side: links them)
        self._caching: Any = None
        #: keys are being re-pointed to another block, not leaving the cache
        self._moving = False
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
        if self.side is ArenaSide.TOKEN:
            events.extend(self.arena.state_pool.take_events())
        return events

    def _new_free_queue(self) -> ArenaFreeBlockQueue:
        return ArenaFreeBlockQueue(
            (self.blocks[i] for i in self.owned_ids if self.blocks[i].ref_cnt == 0),
            low_ids_first=self.side is ArenaSide.TOKEN,
        )

    @property
    def owned_capacity(self) -> int:
        """Blocks this pool owns now (null and reserved ids never count)."""
        return len(self.owned_ids)

    def get_num_used_blocks(self) -> int:
        return self.owned_capacity - self.get_num_free_blocks()

    def get_usage(self) -> float:
        """Used share of the owned blocks (upstream divides by the id space).

        The scheduler asks the token pool once per step for its stats, which
        makes this the place to tell ``on_usage`` (per-pool metrics) too.
        """
        if self.on_usage is not None:
            self.on_usage()
        if not self.owned_capacity:
            return 0.0
        return self.get_num_used_blocks() / self.owned_capacity

    # -- prefix-cache coupling (see prefix_cache_view) ----------------------

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
        links = self.arena.links
        if (
            links is not None
            and self.side is ArenaSide.STATE
            and self._caching is not None
            and num_tokens
        ):
            token_keys = links.token_keys(self._caching.block_hashes, num_tokens)
            cached = self.arena.token_pool.cached_block_hash_to_block
            if all(cached.get_one_block(k) is not None for k in token_keys):
                links.link(block_hash_with_group_id, token_keys)
            else:
                links.link_incomplete(block_hash_with_group_id)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[Any]:
        removed = super()._remove_cached_block_hashes(block)
        if self.arena.links is not None and not self._moving:
            gone = [
                k
                for k in removed
                if self.cached_block_hash_to_block.get_one_block(k) is None
            ]
            if gone:
                self.arena.keys_left_cache(self.side, gone)
        return removed

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        if self.arena.links is not None:
            # upstream routes blocks of another pool there (their own check)
            self.evict_dead(b for b in blocks if b.pool is self)

    def blocks_with(self, key: Any) -> list[KVCacheBlock]:
        """Every block holding a prefix-cache key (duplicates included)."""
        held = self.cached_block_hash_to_block._cache.get(key)
        if held is None:
            return []
        if isinstance(held, KVCacheBlock):
            return [held]
        return list(held.values())

    def is_dead(self, block: KVCacheBlock) -> bool:
        """Whether a cached block can no longer be part of any hit (rules in
        prefix_cache_view's module docstring)."""
        links = self.arena.links
        if links is None or block.block_hash is None:
            return False
        extra = self.cached_block_hashes_by_block.get(block.block_id, ())
        if self.side is ArenaSide.STATE:
            return block.block_hash in links.broken and all(
                k in links.broken for k in extra
            )
        key = block.block_hash
        if extra or not links.couples(key) or links.is_needed(key):
            return False
        size = links.token_groups[get_group_id(key)]
        return (block.block_hash_num_tokens or 0) % size == 0

    def evict_dead(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Evict the free ones among ``blocks`` that are dead."""
        links = self.arena.links
        assert links is not None
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null and self.is_dead(block):
                self._maybe_evict_cached_block(block)
                links.evictions[self.side.value] += 1

    def evict_dead_keys(self, keys: Iterable[Any]) -> None:
        self.evict_dead(b for k in keys for b in self.blocks_with(k))

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
            BlockPool._maybe_evict_cached_block(self, lent)
            lent.ref_cnt += 1
            return [lent]
        if num_blocks > self.get_num_free_blocks():
            self.arena.ensure_side(self.side, num_blocks)
        return super().get_new_blocks(num_blocks)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        evicted = super()._maybe_evict_cached_block(block)
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

    def _clear_prefix_cache(self) -> None:
        links = self.arena.links
        keys = list(self.cached_block_hash_to_block._cache) if links else []
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        # Every free block is clean now: rebuild rather than re-file one by one.
        self.free_block_queue = self._new_free_queue()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        if keys:
            # The other pool may have been reset too, or be busy: drop what
            # this pool's keys meant to it either way.
            self.arena.keys_left_cache(self.side, keys)
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


# ---------------------------------------------------------------------------
# Arena
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BoundaryMove:
    """One boundary move, for logs, metrics and zeroing of gained blocks."""

    old_boundary: int
    new_boundary: int
    grown: ArenaSide
    #: Ids the grown pool gained (to zero if its kernels expect zeros).
    gained_ids: range
    #: Ids the other pool gave up.
    lost_ids: range


class KVArena:
    """The token and state pools of one byte arena and the boundary between
    them (see the module docstring for layout, policy and worst case)."""

    def __init__(
        self,
        layout: ArenaLayout,
        *,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        token_metrics_collector: KVCacheMetricsCollector | None = None,
        state_metrics_collector: KVCacheMetricsCollector | None = None,
        medium: str = MEDIUM_GPU,
    ) -> None:
        self.layout = layout
        self._state_floor = layout.initial_state_floor
        self._moves: list[BoundaryMove] = []
        #: prefix-cache coupling between the pools; None keeps them independent
        self.links: CheckpointLinks | None = None
        common = dict(
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            medium=medium,
        )
        self.token_pool = ArenaBlockPool(
            self,
            ArenaSide.TOKEN,
            layout.num_token_ids,
            layout.token_ids_at(self._state_floor),
            metrics_collector=token_metrics_collector,
            **common,
        )
        self.state_pool = ArenaBlockPool(
            self,
            ArenaSide.STATE,
            layout.num_state_ids,
            layout.state_ids_at(self._state_floor),
            metrics_collector=state_metrics_collector,
            **common,
        )

    # -- read side --------------------------------------------------------

    @property
    def boundary_bytes(self) -> int:
        """First byte of the state pool; the token pool ends at or below it."""
        layout = self.layout
        return layout.state_offset + self._state_floor * layout.state_block_bytes

    @property
    def state_floor(self) -> int:
        return self._state_floor

    @property
    def token_limit(self) -> int:
        return self.layout.token_limit_at(self._state_floor)

    @property
    def token_capacity(self) -> int:
        return self.token_pool.owned_capacity

    @property
    def state_capacity(self) -> int:
        return self.state_pool.owned_capacity

    def pool(self, side: ArenaSide) -> ArenaBlockPool:
        return self.token_pool if side is ArenaSide.TOKEN else self.state_pool

    def take_boundary_moves(self) -> list[BoundaryMove]:
        """Boundary moves since the last call (oldest first)."""
        moves, self._moves = self._moves, []
        return moves

    # -- feasibility and moves ---------------------------------------------

    def can_allocate(
        self, need_token: int, need_state: int, keep: Iterable[KVCacheBlock] = ()
    ) -> bool:
        """Whether both pools can hand out that many blocks, counting at most
        one boundary move. Changes nothing."""
        return self._plan(need_token, need_state, keep) is not None

    def ensure(
        self, need_token: int, need_state: int, keep: Iterable[KVCacheBlock] = ()
    ) -> bool:
        """Make both pools have at least that many free blocks, moving the
        boundary if needed; all-or-nothing, returns whether it succeeded."""
        target = self._plan(need_token, need_state, keep)
        if target is None:
            return False
        if target != self._state_floor:
            self._move_to(target)
        return True

    def ensure_side(self, side: ArenaSide, need: int) -> bool:
        """:meth:`ensure` for one pool only (the other needs nothing)."""
        if side is ArenaSide.TOKEN:
            return self.ensure(need, 0)
        return self.ensure(0, need)

    def _plan(
        self, need_token: int, need_state: int, keep: Iterable[KVCacheBlock] = ()
    ) -> int | None:
        """State floor that satisfies both needs, or None if none does.

        ``keep`` are free cached blocks about to be reused (prefix hits not
        yet touched): a move must not evict them or hand their bytes over.
        """
        kept = {(id(block.pool), block.block_id) for block in keep}
        free_token = self.token_pool.get_num_free_blocks()
        free_state = self.state_pool.get_num_free_blocks()
        short_token = need_token > free_token
        short_state = need_state > free_state
        if not short_token and not short_state:
            return self._state_floor
        if short_token and short_state:
            return None  # a move only ever helps one side
        layout = self.layout
        if short_token:
            capacity = self.token_capacity + need_token - free_token
            target = layout.state_floor_for_token_capacity(capacity)
            if target > layout.max_state_floor:
                return None
            lost = range(self._state_floor, target)
            if free_state - len(lost) < need_state:
                return None
            if not self._all_free(self.state_pool, lost, kept):
                return None
            return target
        target = self._state_floor - (need_state - free_state)
        if target < layout.min_state_floor:
            return None
        lost = self._token_ids_lost(target)
        if free_token - len(lost) < need_token:
            return None
        if not self._all_free(self.token_pool, lost, kept):
            return None
        return target

    def _token_ids_lost(self, target: int) -> range:
        """Owned token ids at or above the token limit of state floor ``target``."""
        owned = self.token_pool.owned_ids
        return range(max(owned.start, self.layout.token_limit_at(target)), owned.stop)

    @staticmethod
    def _all_free(
        pool: ArenaBlockPool, ids: range, kept: set[tuple[int, int]] = frozenset()
    ) -> bool:
        blocks = pool.blocks
        return all(blocks[i].ref_cnt == 0 and (id(pool), i) not in kept for i in ids)

    def _move_to(self, target: int) -> None:
        old_boundary = self.boundary_bytes
        old_token_ids = self.token_pool.owned_ids
        old_state_ids = self.state_pool.owned_ids
        new_token_ids = self.layout.token_ids_at(target)
        new_state_ids = self.layout.state_ids_at(target)
        if target > self._state_floor:
            grown = ArenaSide.TOKEN
            lost = range(old_state_ids.start, new_state_ids.start)
            gained = range(
                max(old_token_ids.stop, new_token_ids.start), new_token_ids.stop
            )
            self.state_pool._give_away(lost)
            self.state_pool.owned_ids = new_state_ids
            self.token_pool.owned_ids = new_token_ids
            self.token_pool._take_over(gained)
        else:
            grown = ArenaSide.STATE
            lost = self._token_ids_lost(target)
            gained = range(new_state_ids.start, old_state_ids.start)
            self.token_pool._give_away(lost)
            self.token_pool.owned_ids = new_token_ids
            self.state_pool.owned_ids = new_state_ids
            self.state_pool._take_over(gained)
        self._state_floor = target
        move = BoundaryMove(old_boundary, self.boundary_bytes, grown, gained, lost)
        self._moves.append(move)
        logger.debug(
            "Arena boundary %d -> %d B: %s pool +%d blocks (token %d, state %d)",
            old_boundary,
            self.boundary_bytes,
            grown.value,
            len(gained),
            self.token_capacity,
            self.state_capacity,
        )

    # -- prefix-cache coupling ----------------------------------------------

    def couple_prefix_caches(self, token_groups: dict[int, int]) -> None:
        """Evict attention blocks no cached checkpoint needs and checkpoints
        whose attention prefix is gone (``token_groups``: block size of each
        full-attention group). Needs prefix caching and empty caches."""
        pools = (self.token_pool, self.state_pool)
        assert all(
            p.enable_caching and not len(p.cached_block_hash_to_block) for p in pools
        )
        self.links = CheckpointLinks(token_groups, self.token_pool.hash_block_size)

    def keys_left_cache(self, side: ArenaSide, keys: list[Any]) -> None:
        """Keys no block of ``side``'s pool holds any more: update the links
        and evict the free blocks that became dead in either pool."""
        links = self.links
        assert links is not None
        if side is ArenaSide.STATE:
            orphans = [t for k in keys for t in links.forget_state(k)]
            self.token_pool.evict_dead_keys(orphans)
            return
        broken: list[Any] = []
        orphans = []
        for key in keys:
            if links.couples(key):
                states, lost = links.forget_token(key)
                broken += states
                orphans += lost
        self.state_pool.evict_dead_keys(broken)
        self.token_pool.evict_dead_keys(orphans)

    # -- whole-arena operations --------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Reset both pools' prefix caches, only if every owned block of both
        pools is free (upstream's single pool semantics)."""
        pools = (self.token_pool, self.state_pool)
        busy = {p.side.value: p.get_num_used_blocks() for p in pools}
        if any(busy.values()):
            logger.warning("Prefix cache not reset: blocks still in use %s", busy)
            return False
        for pool in pools:
            pool._clear_prefix_cache()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests)."""
        layout = self.layout
        s_floor = self._state_floor
        _require(
            layout.min_state_floor <= s_floor <= layout.max_state_floor,
            f"state floor {s_floor} outside [{layout.min_state_floor}, "
            f"{layout.max_state_floor}]",
        )
        token_ids, state_ids = self.token_pool.owned_ids, self.state_pool.owned_ids
        _require(token_ids == layout.token_ids_at(s_floor), "token ownership drift")
        _require(state_ids == layout.state_ids_at(s_floor), "state ownership drift")
        if token_ids and state_ids:
            _require(
                token_ids.stop * layout.token_block_bytes
                <= layout.state_offset + state_ids.start * layout.state_block_bytes,
                "a byte is owned by both pools",
            )
        _require(
            token_ids.start >= layout.first_token_id
            and state_ids.start >= layout.first_state_id,
            "a pool owns a null or reserved id",
        )
        _require(
            state_ids.stop == layout.num_state_ids
            and token_ids.stop <= layout.num_token_ids,
            "a pool owns ids past the arena",
        )
        for pool in (self.token_pool, self.state_pool):
            _check_pool(pool)
        if self.links is not None:
            self.links.check(
                self.state_pool.cached_block_hash_to_block._cache,
                set(self.token_pool.cached_block_hash_to_block._cache),
            )
            for pool in (self.token_pool, self.state_pool):
                for i in pool.free_block_queue.cached_ids():
                    _require(
                        not pool.is_dead(pool.blocks[i]),
                        f"{pool.side.value}: dead block {i} kept in the prefix cache",
                    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _check_pool(pool: ArenaBlockPool) -> None:
    """Per-pool part of :meth:`KVArena.check_invariants`."""
    name = pool.side.value
    queue = pool.free_block_queue
    owned = pool.owned_ids
    _require(pool.null_block is pool.blocks[0] and pool.null_block.is_null, "null")
    _require(pool.null_block not in queue, f"{name}: null block in free queue")
    free_ids = set(queue.clean_ids()) | set(queue.cached_ids())
    _require(len(free_ids) == queue.num_free_blocks, f"{name}: queue count")
    expected = {i for i in owned if pool.blocks[i].ref_cnt == 0}
    _require(free_ids == expected, f"{name}: free queue != owned blocks at ref 0")
    used = sum(1 for i in owned if pool.blocks[i].ref_cnt > 0)
    _require(
        queue.num_free_blocks + used == pool.owned_capacity,
        f"{name}: free + used != owned capacity",
    )
    for i in queue.clean_ids():
        _require(pool.blocks[i].block_hash is None, f"{name}: hashed block {i} clean")
    for i in queue.cached_ids():
        _require(pool.blocks[i].block_hash is not None, f"{name}: cached {i} no hash")
    for block in pool.blocks[1:]:
        _require(block.ref_cnt >= 0, f"{name}: block {block.block_id} ref_cnt < 0")
        if block.block_id not in owned:
            _require(
                block.ref_cnt == 0
                and block.block_hash is None
                and block.block_id not in pool.cached_block_hashes_by_block,
                f"{name}: unowned block {block.block_id} is in use or cached",
            )
