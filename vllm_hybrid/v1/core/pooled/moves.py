"""Moving live token blocks out of the way of the state pool's growth.

The state pool grows only over free token ids next to the boundary, which a
request admitted while the token pool was full may hold until it ends. A
move gives each live token block in the way the id of a free one elsewhere
(``ArenaBlockPool.swap_ids``); holders keep the block object. The workers
copy the bytes and rename the block in their block tables before the step
runs (``vllm_hybrid.v1.worker.token_moves``), from the step's moves composed
into one old-id to new-id mapping on the scheduler's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.coupling import PrefixCacheCoupling

#: The ``SchedulerOutput`` attribute that carries a step's moves to the
#: workers (:meth:`TokenMoves.take`'s mapping; absent when none moved).
MOVES_ATTRIBUTE = "hybrid_token_moves"


@dataclass
class TokenMoves:
    """The token blocks moved since the workers last heard of moves.

    Moves within one step compose (A to B, then B to C, is A to C), so the
    workers apply the mapping at once, every source read before any
    destination is written.
    """

    #: old id -> current id of every block moved since the last take
    pending: dict[int, int] = field(default_factory=dict)
    #: blocks moved in all
    blocks: int = 0
    #: called with (old id, new id) at each block's move, for holders of
    #: plain ids (the managers' lists of new blocks to zero)
    listeners: list[Callable[[int, int], None]] = field(default_factory=list)
    #: current id -> id the workers know, for the blocks in ``pending``
    _known_as: dict[int, int] = field(default_factory=dict)

    def record(self, old: int, new: int) -> None:
        """The block at ``old`` is at ``new`` now."""
        origin = self._known_as.pop(old, old)
        if origin == new:
            del self.pending[origin]
        else:
            self.pending[origin] = new
            self._known_as[new] = origin
        self.blocks += 1
        for listener in self.listeners:
            listener(old, new)

    def take(self) -> dict[int, int]:
        """The moves the workers have not heard of yet, now handed out."""
        pending, self.pending = self.pending, {}
        self._known_as = {}
        return pending


def plan_moves(
    pool: ArenaBlockPool, ids: range, kept: set[tuple[int, int]]
) -> tuple[tuple[KVCacheBlock, KVCacheBlock], ...] | None:
    """(live block, free destination) for every live block of ``pool`` at
    ``ids``; None when some are ``kept``, none is live or they cannot all
    move. Changes nothing; the caller checked that the free blocks outside
    ``ids`` cover the pool's need after the moves."""
    blocks = pool.blocks
    if any((id(pool), i) in kept for i in ids):
        return None
    live = [blocks[i] for i in ids if blocks[i].ref_cnt]
    return pair_with_free(pool, live, ids, kept) if live else None


def pair_with_free(
    pool: ArenaBlockPool,
    live: list[KVCacheBlock],
    avoid: range,
    kept: set[tuple[int, int]],
) -> tuple[tuple[KVCacheBlock, KVCacheBlock], ...] | None:
    """Each of ``live`` paired with a free block of ``pool`` outside
    ``avoid`` and not ``kept``, in hand-out order (clean first, so moves
    evict as little as an allocation would); None when one may not move or
    too few are free there."""
    if not all(pool.can_move(block) for block in live):
        return None
    found: list[KVCacheBlock] = []
    for block in pool.free_block_queue.get_all_free_blocks():
        if block.block_id in avoid or (id(pool), block.block_id) in kept:
            continue
        found.append(block)
        if len(found) == len(live):
            return tuple(zip(live, found, strict=True))
    return None


def move_live_blocks(
    pool: ArenaBlockPool,
    planned: tuple[tuple[KVCacheBlock, KVCacheBlock], ...],
    moves: TokenMoves,
    coupling: PrefixCacheCoupling | None = None,
) -> None:
    """Carry out :func:`plan_moves`, recorded in ``moves``; the
    ``coupling``, if any, settles after each move."""
    for block, target in planned:
        old = block.block_id
        pool.swap_ids(block, target)
        if coupling is not None:
            coupling.settle()
        moves.record(old, block.block_id)


def new_block_ids_follow(
    managers: Iterable[SingleTypeKVCacheManager],
) -> Callable[[int, int], None]:
    """A listener that renames a moved block in the ``managers``' lists of
    this step's new block ids (plain ids the workers zero)."""
    managers = list(managers)

    def rename(old: int, new: int) -> None:
        for manager in managers:
            ids = manager.new_block_ids
            for i, block_id in enumerate(ids):
                if block_id == old:
                    ids[i] = new

    return rename
