"""The free-block queue of one arena pool.

The order in which free blocks are handed out is what keeps the arena's
boundary movable and the useful prefix-cache entries cached; the order itself
is :mod:`.policy.eviction`'s, this module keeps blocks in it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, count, islice, takewhile

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_hybrid.v1.core.pooled.policy.eviction import (
    CLEAN_SEGMENTS,
    CLEARING_ORDER,
    HAND_OUT_ORDER,
    SPARED,
    EvictionPolicy,
    Place,
    Reach,
    Segment,
)


class ArenaFreeBlockQueue:
    """Free blocks of one arena pool, in the order of :mod:`.policy.eviction`.

    Upstream's ``FreeKVCacheBlockQueue`` interface, as ``BlockPool`` and the
    simple KV offloader use it, with one segment per
    :class:`~.policy.eviction.Segment`. Both clean segments share one heap
    of ids, farthest from the boundary first, split at
    :attr:`EvictionPolicy.held_from`; a cached one is an LRU list whose
    ``append_n``/``prepend_n`` keep upstream's meaning, and a pop takes, of
    the ``window`` oldest, the one the order names. A block is filed where
    :meth:`EvictionPolicy.segment_of` says when it enters, and re-filed
    (:meth:`refile_n`) when its hash changes while free. The blocks'
    ``prev_free_block``/``next_free_block`` links are not used.
    """

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock],
        low_ids_first: bool,
        window: int = 1,
        clock: Iterator[int] | None = None,
    ) -> None:
        self.low_ids_first = low_ids_first
        #: filing ticks; the arena's two pools share one, so ages compare
        self._clock = count() if clock is None else clock
        #: tick at which each cached free block was last filed
        self._filed_at: dict[int, int] = {}
        #: oldest cached blocks among which a pop picks by position
        self.window = window
        #: whether the clean blocks next to the boundary go after the cached
        #: ones (:data:`~.policy.eviction.CLEARING_ORDER`)
        self.clearing = False
        #: the order's per-pool state (prefix hits per cached block)
        self.policy = EvictionPolicy()
        #: clean blocks of both clean segments, in a heap by hand-out order
        self._clean = _CleanBlocks(self._id_to_key, self.policy.is_held)
        self._lru: dict[Segment, OrderedDict[int, KVCacheBlock]] = {
            segment: OrderedDict()
            for segment in HAND_OUT_ORDER
            if segment not in CLEAN_SEGMENTS
        }
        #: cached ids filed at their segment's head and not moved since: a
        #: prefix of the segment, handed out before the rest of it
        self._front: set[int] = set()
        #: the segment each free block is filed in, by id
        self._where: dict[int, dict[int, KVCacheBlock]] = {}
        self.append_n(list(blocks))

    # -- read side --------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + sum(map(len, self._lru.values()))

    @property
    def order(self) -> tuple[Segment, ...]:
        """The segments in the order pops take them now."""
        return CLEARING_ORDER if self.clearing else HAND_OUT_ORDER

    def num_free_within(self, reach: Reach) -> int:
        """Free blocks an allocation of ``reach`` may take (what it spares
        are cached segments)."""
        return self.num_free_blocks - sum(len(self._lru[s]) for s in SPARED[reach])

    def spared_ids(self, reach: Reach) -> list[int]:
        """Ids of free blocks an allocation of ``reach`` must leave alone."""
        return [bid for s in SPARED[reach] for bid in self._ids_of(s)]

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return self._holder(block) is not None

    def is_protected(self, block: KVCacheBlock) -> bool:
        """Whether ``block`` is free in the protected segment."""
        return self._lru[Segment.PROTECTED].get(block.block_id) is block

    def num_clean_first(self) -> int:
        """Clean free blocks handed out before any cached one: an allocation
        of at most this many evicts nothing. O(1)."""
        clean = self._clean
        return len(clean) - clean.num_held if self.clearing else len(clean)

    def num_free_before_lru(self, need: int) -> int:
        """Free blocks handed out before any cached block filed in LRU
        order (clean ones, then those filed at the cached segment's head),
        counted up to ``need``: O(need), as it runs on every allocation."""
        found = self.num_clean_first()
        if found >= need:
            return found
        head = takewhile(self._front.__contains__, self._lru[Segment.CACHED])
        return found + sum(1 for _ in islice(head, need - found))

    def oldest_lru_tick(self) -> int | None:
        """Filing tick of the next entry an allocation past the clean and
        head-filed blocks evicts; None if there is none."""
        _, rest = self._split_front(self._lru[Segment.CACHED])
        oldest = next(rest, None)
        return None if oldest is None else self._filed_at[oldest]

    def filed_tick(self, block: KVCacheBlock) -> int | None:
        """Tick at which a free cached block was filed; None for a clean
        one (meaningless for a block in use: old ticks are not dropped)."""
        if self._clean.get(block.block_id) is block:
            return None
        return self._filed_at[block.block_id]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in the order ``popleft`` would return them."""
        where = self._where
        return [where[bid][bid] for s in self.order for bid in self._ids_of(s)]

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in hand-out order after ``cursor`` (all if None, none
        if it is no longer free, like upstream's list); O(n), for the simple
        KV offloader."""
        blocks = self.get_all_free_blocks()
        if cursor is not None:
            at = [i for i, block in enumerate(blocks) if block is cursor]
            blocks = blocks[at[0] + 1 :] if at else []
        yield from blocks

    # -- write side -------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        for segment in self.order:
            block = self._pop_first(segment)
            if block is not None:
                return block
        raise ValueError("No free blocks available in the arena pool")

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:  # upstream's pool's words
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        holder = self._holder(block)
        if holder is None:
            raise RuntimeError(f"remove() of block {block.block_id}, which is not free")
        self._unfile(block.block_id, holder)

    def remove_clean(self, blocks: list[KVCacheBlock]) -> None:
        """Remove clean free blocks, many at once (a boundary move)."""
        where, clean = self._where, self._clean
        for block in blocks:
            if where.pop(block.block_id, None) is not clean:
                raise RuntimeError(
                    f"remove_clean() of block {block.block_id}, not a clean free one"
                )
            clean.discard(block.block_id)
        clean.compact()

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        self._file(blocks, Place.TAIL)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        # Filed in reverse, each at its segment's head: first given first.
        self._file(reversed(blocks), Place.HEAD)

    def place(self, block: KVCacheBlock, place: Place) -> None:
        """Move a free cached block to the head or tail of its segment."""
        self.remove(block)
        self._file((block,), place)

    def refile_n(self, blocks: list[KVCacheBlock]) -> None:
        """Re-file, in order, the free ones among ``blocks`` whose hash
        changed (cached to clean or back)."""
        moved = []
        for block in blocks:
            holder = self._holder(block)
            if holder is not None and (
                isinstance(holder, _CleanBlocks) != (block.block_hash is None)
            ):
                self._unfile(block.block_id, holder)
                moved.append(block)
        self._file(moved, Place.TAIL)

    def hold_clean_from(self, start: int | None) -> None:
        """File clean blocks with ids from ``start`` on apart
        (:attr:`~.policy.eviction.Segment.CLEAN_AT_BOUNDARY`; None: none).
        Only the token pool holds any: its clean ids go lowest first, so the
        held ones are the heap's last and no block is re-filed."""
        assert start is None or self.low_ids_first, "only the token pool holds"
        old, self.policy.held_from = self.policy.held_from, start
        if old != start:
            self._clean.recount(old, start)

    # -- helpers ----------------------------------------------------------

    def _ids_of(self, segment: Segment) -> list[int]:
        """A segment's ids in the order pops would return them."""
        if segment in CLEAN_SEGMENTS:
            ids = self._clean.ids()
            cut = len(ids) - self._clean.num_held
            return ids[cut:] if segment is Segment.CLEAN_AT_BOUNDARY else ids[:cut]
        front, rest = self._split_front(self._lru[segment])
        return [
            *_windowed(front, self.window, self._pop_key),
            *_windowed(rest, self.window, self._pop_key),
        ]

    def _split_front(
        self, lru: OrderedDict[int, KVCacheBlock]
    ) -> tuple[list[int], Iterator[int]]:
        """A segment's ids filed at its head (a prefix), and an iterator
        over the rest."""
        it = iter(lru)
        front: list[int] = []
        for bid in it:
            if bid not in self._front:
                return front, chain((bid,), it)
            front.append(bid)
        return front, iter(())

    def _holder(self, block: KVCacheBlock) -> dict[int, KVCacheBlock] | None:
        held = self._where.get(block.block_id)
        return held if held is not None and held.get(block.block_id) is block else None

    def _unfile(self, bid: int, holder: dict[int, KVCacheBlock]) -> None:
        del self._where[bid]
        self._front.discard(bid)
        if holder is self._clean:
            holder.discard(bid)
            holder.compact()  # its heap entry goes stale
        else:
            del holder[bid]

    def _file(self, blocks: Iterable[KVCacheBlock], place: Place) -> None:
        """File blocks not in the queue where the order puts them, at the
        head or tail of their segment (one call for a request's thousands
        of freed blocks; one block when a free block's rank changes)."""
        where, segment_of, clean = self._where, self.policy.segment_of, self._clean
        lrus, filed_at, clock = self._lru, self._filed_at, self._clock
        head = place is Place.HEAD
        for block in blocks:
            bid = block.block_id
            if bid in where:
                raise RuntimeError(f"block {bid} is already in the free queue")
            segment = segment_of(block)
            if segment in CLEAN_SEGMENTS:
                clean.add(block)
                where[bid] = clean
                continue
            where[bid] = lru = lrus[segment]
            lru[bid] = block
            filed_at[bid] = next(clock)
            if head:
                lru.move_to_end(bid, last=False)
                self._front.add(bid)

    def _pop_first(self, segment: Segment) -> KVCacheBlock | None:
        if segment not in CLEAN_SEGMENTS:
            lru = self._lru[segment]
            if not lru:
                return None
            oldest = list(islice(lru, self.window))
            if oldest[0] in self._front:
                # entries filed at the head go first, as the order says
                oldest = list(takewhile(self._front.__contains__, oldest))
            bid = min(oldest, key=self._pop_key)
            self._front.discard(bid)
            del self._where[bid]
            return lru.pop(bid)
        # the order asks for CLEAN first: the heap's first is the segment's
        block = self._clean.pop_first(segment is Segment.CLEAN_AT_BOUNDARY)
        if block is not None:
            del self._where[block.block_id]
        return block

    def _pop_key(self, bid: int) -> tuple[bool, int]:
        """Order of a pop among the window's oldest cached blocks: those
        worth no more per byte than attention KV first, then farthest from
        the boundary."""
        return self.policy.worth_more(bid), self._id_to_key(bid)

    def _id_to_key(self, bid: int) -> int:
        return bid if self.low_ids_first else -bid


def _windowed(ids: Iterable[int], window: int, key) -> list[int]:
    """``ids`` (oldest first) in the order repeated pops take them: each pop
    takes the smallest ``key`` among the ``window`` oldest left. A heap over
    the sliding window gives that order in O(n log window)."""
    it = iter(ids)
    heap = [(key(bid), bid) for bid in islice(it, window)]
    heapq.heapify(heap)
    out: list[int] = []
    while heap:
        out.append(heapq.heappop(heap)[1])
        nxt = next(it, None)
        if nxt is not None:
            heapq.heappush(heap, (key(nxt), nxt))
    return out


class _CleanBlocks(dict[int, KVCacheBlock]):
    """Clean free blocks by id, with a min-heap of their hand-out keys and
    lazy deletion, counting the ``held`` ones (last in the heap's order)."""

    def __init__(self, key: Callable[[int], int], held: Callable[[int], bool]) -> None:
        super().__init__()
        self._key, self._held = key, held
        self._heap: list[tuple[int, int]] = []
        #: clean blocks in :attr:`~.policy.eviction.Segment.CLEAN_AT_BOUNDARY`
        self.num_held = 0

    def add(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        self[bid] = block
        heapq.heappush(self._heap, (self._key(bid), bid))
        self.num_held += self._held(bid)

    def discard(self, bid: int) -> None:
        del self[bid]
        self.num_held -= self._held(bid)

    def pop_first(self, held: bool) -> KVCacheBlock | None:
        """The heap's first block if it is ``held`` or not as asked."""
        heap = self._heap
        while heap and heap[0][1] not in self:
            heapq.heappop(heap)
        if not heap or self._held(heap[0][1]) is not held:
            return None
        bid = heapq.heappop(heap)[1]
        self.num_held -= held
        return self.pop(bid)

    def recount(self, old: int | None, start: int | None) -> None:
        """Held ids started at ``old`` and start at ``start`` now: O(ids
        between the two, a boundary move's), or O(blocks) from or to none."""
        if old is None or start is None:
            self.num_held = sum(map(self._held, self))
            return
        between = sum(1 for i in range(min(old, start), max(old, start)) if i in self)
        self.num_held += between if start < old else -between

    def ids(self) -> list[int]:
        """Ids in the order pops would return them."""
        return sorted(self, key=self._key)

    def compact(self) -> None:
        """Drop stale heap entries once they outnumber live ones, so the heap
        stays O(blocks) however many removals happen."""
        if len(self._heap) > 2 * len(self) + 64:
            self._heap = [(self._key(bid), bid) for bid in self]
            heapq.heapify(self._heap)
