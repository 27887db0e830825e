"""Moving live token blocks out of the way of the state pool's growth.

The state pool grows only over free token ids next to the boundary; a
request admitted while the token pool was full may hold them until it ends.
A move gives each live token block in the way the id of a free token block
elsewhere (``ArenaBlockPool.swap_ids``): every holder keeps the block
object, and its prefix-cache keys, hits and metrics follow the id. The
workers copy each moved block's bytes and rename it in their block tables
before the step runs (``vllm_hybrid.v1.worker.token_moves``); the scheduler
hands them the step's moves, composed into one old-id to new-id mapping,
on its output.
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

    ``pending`` maps the id a moved block had when the workers last saw it
    to the id it has now: moves within one step compose (a block moved from
    A to B and then from B to C is one move from A to C), so the workers
    apply the mapping at once, every source read before any destination is
    written.
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
    ``ids``, so that all of them would be free; None when some are ``kept``,
    none is live (a move would not help) or they cannot all move
    (:func:`pair_with_free`). Changes nothing; the caller has checked that
    the pool's free blocks outside ``ids`` cover its own need after the
    moves."""
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
    ``avoid`` and not ``kept``, in the order the pool hands blocks out (clean
    ones first, so that moves evict as few cached entries as an allocation
    would); None when one may not move (``ArenaBlockPool.can_move``) or too
    few are free there."""
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
    """Carry out :func:`plan_moves`: each live block takes its destination's
    id (``ArenaBlockPool.swap_ids``), recorded in ``moves``; the
    ``coupling``, if any, handles what each destination's eviction made dead
    before the next move."""
    for block, target in planned:
        old = block.block_id
        pool.swap_ids(block, target)
        if coupling is not None:
            coupling.settle()
        moves.record(old, block.block_id)


def new_block_ids_follow(
    managers: Iterable[SingleTypeKVCacheManager],
) -> Callable[[int, int], None]:
    """A listener (:attr:`TokenMoves.listeners`) that renames a moved block
    in the ``managers``' lists of this step's new block ids, which upstream
    keeps as plain ids for the workers to zero."""
    managers = list(managers)

    def rename(old: int, new: int) -> None:
        for manager in managers:
            ids = manager.new_block_ids
            for i, block_id in enumerate(ids):
                if block_id == old:
                    ids[i] = new

    return rename
