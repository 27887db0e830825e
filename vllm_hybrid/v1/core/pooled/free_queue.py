"""The free-block queue of one arena pool.

The order in which free blocks are handed out is what keeps the arena's
boundary movable: clean blocks farthest from the boundary go first, blocks
next to it last (see :mod:`.arena`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from vllm.v1.core.kv_cache_utils import KVCacheBlock


class ArenaFreeBlockQueue:
    """Free blocks of one arena pool, in the order the arena wants them reused.

    Same interface as upstream's ``FreeKVCacheBlockQueue`` as ``BlockPool`` and
    the simple KV offloader use it, different order:

    1. *clean* blocks (no prefix-cache hash) first, farthest from the boundary
       first: a min-heap of ids (token side) or of negated ids (state side) with
       lazy deletion, so every operation is O(log n) amortised;
    2. then *cached* blocks (hash set), least recently freed first. Upstream's
       ``append_n`` puts them at the LRU tail and ``prepend_n`` at the head,
       in the given order; both are kept;
    3. cached blocks that ``protected`` picks (entries that served several
       prefix hits) form a second LRU segment, handed out only when the
       first is empty: a segmented LRU, so a burst of one-off entries (new
       prompts, answers nobody follows up) cannot flush entries that proved
       their worth.

    A block is filed by its hash when it enters the queue; :meth:`refile` moves
    it when its hash changes while free (eviction by id, cache reset). The
    ``prev_free_block``/``next_free_block`` links of blocks are not used.
    """

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock],
        low_ids_first: bool,
        protected: Callable[[KVCacheBlock], bool] | None = None,
    ) -> None:
        self.low_ids_first = low_ids_first
        self._is_protected = protected or (lambda block: False)
        self._clean: dict[int, KVCacheBlock] = {}
        self._heap: list[int] = []
        self._cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._protected: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.append_n(list(blocks))

    # -- read side --------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._cached) + len(self._protected)

    @property
    def num_protected_blocks(self) -> int:
        """Free blocks in the protected segment (handed out last)."""
        return len(self._protected)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        bid = block.block_id
        return any(
            segment.get(bid) is block
            for segment in (self._clean, self._cached, self._protected)
        )

    def is_protected(self, block: KVCacheBlock) -> bool:
        """Whether ``block`` is free in the protected segment."""
        return self._protected.get(block.block_id) is block

    def clean_ids(self) -> list[int]:
        """Ids of clean free blocks, in hand-out order."""
        return sorted(self._clean, reverse=not self.low_ids_first)

    def cached_ids(self) -> list[int]:
        """Ids of cached free blocks, in hand-out order (LRU, then the
        protected segment's LRU)."""
        return list(self._cached) + list(self._protected)

    def protected_ids(self) -> list[int]:
        """Ids of the protected segment, in hand-out order."""
        return list(self._protected)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in the order ``popleft`` would return them."""
        clean = [self._clean[bid] for bid in self.clean_ids()]
        return clean + list(self._cached.values()) + list(self._protected.values())

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
        for segment in (self._cached, self._protected):
            if segment:
                return segment.popitem(last=False)[1]
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
        elif self._protected.get(bid) is block:
            del self._protected[bid]
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
                self._segment_of(block)[block.block_id] = block

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        cached = []
        for block in blocks:
            self._check_absent(block)
            if block.block_hash is None:
                self._push_clean(block)
            else:
                cached.append(block)
        # Put the cached ones at their segment's LRU head, first given first.
        for block in reversed(cached):
            segment = self._segment_of(block)
            segment[block.block_id] = block
            segment.move_to_end(block.block_id, last=False)

    def refile(self, block: KVCacheBlock) -> None:
        """Re-file a free block whose hash changed; no-op if not free."""
        bid = block.block_id
        if block.block_hash is None:
            for segment in (self._cached, self._protected):
                if segment.get(bid) is block:
                    del segment[bid]
                    self._push_clean(block)
        elif self._clean.get(bid) is block:
            del self._clean[bid]
            self._segment_of(block)[bid] = block

    # -- helpers ----------------------------------------------------------

    def _id_to_key(self, bid: int) -> int:
        return bid if self.low_ids_first else -bid

    _key_to_id = _id_to_key  # negation is its own inverse

    def _segment_of(self, block: KVCacheBlock) -> OrderedDict[int, KVCacheBlock]:
        return self._protected if self._is_protected(block) else self._cached

    def _push_clean(self, block: KVCacheBlock) -> None:
        self._clean[block.block_id] = block
        heapq.heappush(self._heap, self._id_to_key(block.block_id))

    def _check_absent(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if bid in self._clean or bid in self._cached or bid in self._protected:
            raise RuntimeError(f"block {bid} is already in the free queue")

    def _maybe_compact(self) -> None:
        """Drop stale heap entries once they outnumber live ones, so the heap
        stays O(free blocks) however many removals happen."""
        if len(self._heap) > 2 * len(self._clean) + 64:
            self._heap = [self._id_to_key(bid) for bid in self._clean]
            heapq.heapify(self._heap)
