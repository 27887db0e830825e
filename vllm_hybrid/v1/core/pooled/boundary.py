"""The boundary between the arena's token and state pools: where it starts,
how far and when it moves, and how a request's blocks are served.

- It starts with room for ``max_num_seqs`` requests' states, at most half
  the arena; the token pool keeps :data:`MIN_TOKEN_BLOCKS` and the state
  pool one lone request's blocks whatever happens (the layout's floors).
- It moves on demand, by the fewest state blocks that cover a pool's
  deficit, and by recency: a pool that would evict an entry takes the other
  pool's blocks next to the boundary when the other pool's oldest entry is
  older. The ids that change pools must be free and not about to serve a
  prefix hit; live token blocks alone in the state pool's way move to free
  ones first (:mod:`.moves`). All or nothing.
- :meth:`ArenaBoundary.plan` decides without changing anything;
  :meth:`ArenaBoundary.carry_out` moves.

A live block next to the boundary pins it until its request ends; blocks
next to it are handed out last (:mod:`.policy.eviction`), so that needs the
pinned pool to have been full.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.coupling import PrefixCacheCoupling
from vllm_hybrid.v1.core.pooled.free_queue import ArenaFreeBlockQueue
from vllm_hybrid.v1.core.pooled.moves import TokenMoves, move_live_blocks, plan_moves
from vllm_hybrid.v1.core.pooled.policy.eviction import (
    ADMISSION,
    SPLIT_TOKEN_RESERVE,
    Reach,
)
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PoolKind

logger = init_logger(__name__)

#: Blocks the token pool keeps whatever the state pool needs.
MIN_TOKEN_BLOCKS = 1


def initial_state_blocks(
    arena_bytes: int, state_block_bytes: int, per_request: int, max_num_seqs: int
) -> int:
    """State blocks the state pool starts with: room for ``max_num_seqs``
    requests' states, at most half the arena, at least one request's."""
    half = (arena_bytes // 2) // state_block_bytes
    return max(per_request, min(max_num_seqs * per_request, half))


def plan_arena_layout(
    arena_bytes: int,
    token_block_bytes: int,
    state_block_bytes: int,
    lone_state_blocks: int,
    null_blocks_overlap: bool,
    state_blocks: int,
) -> ArenaLayout | None:
    """The arena geometry with ``state_blocks`` state blocks, or else the
    state pool at its floor (``lone_state_blocks``); None when the floors do
    not fit at all."""
    arena, sb = arena_bytes, state_block_bytes
    offset = arena % sb if null_blocks_overlap else 0
    wished = arena - state_blocks * sb
    at_floor = offset + (arena // sb - lone_state_blocks) * sb
    for candidate in (wished, at_floor):
        try:
            return ArenaLayout(
                arena_bytes=arena,
                token_block_bytes=token_block_bytes,
                state_block_bytes=sb,
                min_token_blocks=MIN_TOKEN_BLOCKS,
                min_state_blocks=lone_state_blocks,
                initial_boundary=max(0, candidate),
                null_blocks_overlap=null_blocks_overlap,
            )
        except ValueError:
            continue
    return None


def max_token_blocks(layout: ArenaLayout) -> int:
    """Token blocks one request can use: the state pool at its floor."""
    return layout.token_capacity_at(layout.max_state_floor)


class BoundaryPlan(NamedTuple):
    """How the boundary serves one allocation, planned without changing
    anything and carried out once (a tuple: one is made per allocation)."""

    #: the state floor after the allocation (the current one: no move)
    target: int
    #: token blocks the token pool gains (negative: loses) by the move
    token_gain: int = 0
    #: live token blocks that move to free ones first, (live, free) pairs
    moves: tuple[tuple[KVCacheBlock, KVCacheBlock], ...] = ()
    #: served by the attempt that lets a running request advance in place
    in_place: bool = False


class ArenaBoundary:
    """The boundary of one arena (module docstring): the only owner of which
    ids each pool owns."""

    def __init__(
        self,
        layout: ArenaLayout,
        token_pool: ArenaBlockPool,
        state_pool: ArenaBlockPool,
    ) -> None:
        self.layout = layout
        self.token_pool = token_pool
        self.state_pool = state_pool
        self._state_floor = layout.initial_state_floor
        #: token blocks at the planned boundary (a recency move's reserve)
        self._initial_token_capacity = layout.token_capacity_at(
            layout.initial_state_floor
        )
        #: handles the prefix-cache events of each resize (set by the arena)
        self.coupling: PrefixCacheCoupling | None = None
        #: live token blocks moved out of the state pool's way (None: none
        #: may move until the scheduler calls :meth:`allow_moves`)
        self.moves: TokenMoves | None = None

    def allow_moves(self) -> TokenMoves:
        """Let live token blocks move off the boundary from now on; the
        record of their moves, which someone must hand to the workers."""
        if self.moves is None:
            self.moves = TokenMoves()
        return self.moves

    # -- read side --------------------------------------------------------

    @property
    def state_floor(self) -> int:
        """Lowest id the state pool owns."""
        return self._state_floor

    @property
    def boundary_bytes(self) -> int:
        """First byte of the state pool; the token pool ends at or below it."""
        return self.layout.boundary_at(self._state_floor)

    def plan(
        self,
        need_token: int,
        need_state: int,
        keep: Sequence[KVCacheBlock] = (),
        in_place: int = 0,
    ) -> BoundaryPlan | None:
        """How both pools can hand out a request's new blocks, trying the ways
        of :data:`~.policy.eviction.ADMISSION` in order; None when none can.

        ``keep``: free cached blocks about to serve a prefix hit, which a
        move must not evict or hand over. ``in_place``: state blocks of the
        request that may advance in place instead. A need beyond the state
        pool's id space is upstream's way of deferring a prefix hit: refused.
        """
        if (
            need_token <= self.token_pool.free_block_queue.num_clean_first()
            and need_state <= self.state_pool.free_block_queue.num_clean_first()
        ):
            # clean blocks serve both needs: no pool is short and none would
            # evict an entry, so there is nothing to move (the common case)
            return BoundaryPlan(self._state_floor)
        if need_state > self.layout.num_state_ids:
            return None
        for attempt in ADMISSION:
            if attempt.in_place and not in_place:
                continue
            state = need_state - in_place if attempt.in_place else need_state
            found = self._plan(need_token, state, keep, attempt.reach)
            if found is not None:
                target, gain, moves, _ = found
                return BoundaryPlan(target, gain, moves, attempt.in_place)
        return None

    # -- moves ------------------------------------------------------------

    def carry_out(self, plan: BoundaryPlan) -> None:
        """Move the live token blocks of ``plan``, then the boundary."""
        if plan.moves:
            assert self.moves is not None, "token moves planned while not allowed"
            move_live_blocks(self.token_pool, plan.moves, self.moves, self.coupling)
        if plan.target != self._state_floor:
            self._move_to(plan.target)

    # -- the move rule ------------------------------------------------------

    def _plan(
        self,
        need_token: int,
        need_state: int,
        keep: Sequence[KVCacheBlock],
        reach: Reach,
    ) -> BoundaryPlan | None:
        """A plan that satisfies both needs within ``reach``, or None. Where
        token moves are allowed, live token blocks alone in the state pool's
        way are planned to move (:func:`~.moves.plan_moves`)."""
        token, state = self.token_pool, self.state_pool
        free_token = token.get_num_free_within(reach)
        free_state = state.get_num_free_within(reach)
        short_token = need_token > free_token
        short_state = need_state > free_state
        if not short_token and not short_state:
            target = self._recency_target(
                need_token, need_state, free_token, free_state, keep
            )
            return self._to(self._state_floor if target is None else target)
        if short_token and short_state:
            return None  # a move only ever helps one side
        layout = self.layout
        if short_token:
            capacity = token.owned_capacity + need_token - free_token
            target = layout.state_floor_for_token_capacity(capacity)
            if target > layout.max_state_floor:
                return None
            lost = range(self._state_floor, target)
            if free_state - len(lost) < need_state:
                return None
            kept = self._kept(keep, reach)
            return self._to(target) if _all_free(state, lost, kept) else None
        target = self._state_floor - (need_state - free_state)
        if target < layout.min_state_floor:
            return None
        lost = self._token_ids_lost(target)
        if free_token - len(lost) < need_token:
            return None
        kept = self._kept(keep, reach)
        if _all_free(token, lost, kept):
            return self._to(target)
        if self.moves is None:
            return None
        moves = plan_moves(token, lost, kept)
        return None if moves is None else self._to(target, moves)

    def _to(
        self,
        target: int,
        moves: tuple[tuple[KVCacheBlock, KVCacheBlock], ...] = (),
    ) -> BoundaryPlan:
        """The plan of a move to ``target`` (none when it is the floor)."""
        layout = self.layout
        gain = layout.token_capacity_at(target) - layout.token_capacity_at(
            self._state_floor
        )
        return BoundaryPlan(target, gain, moves)

    def _recency_target(
        self,
        need_token: int,
        need_state: int,
        free_token: int,
        free_state: int,
        keep: Iterable[KVCacheBlock],
    ) -> int | None:
        """State floor of a recency move, None when neither pool makes one.

        A pool whose need would evict a cached entry filed in LRU order (its
        *victim*) takes the other pool's free blocks next to the boundary
        instead, when the other pool's next victim is older (or it has none)
        and the other pool keeps enough for its own need. The state pool
        grows only into token blocks clean or filed before its victim, and
        leaves the token pool :data:`~.policy.eviction.SPLIT_TOKEN_RESERVE`
        of its planned blocks: one state block takes hundreds of token
        blocks, parts of many cached prefixes. The token pool takes state
        blocks whatever their age (the state pool hands out those far from
        the boundary first, so the ones next to it are often recent; each is
        one entry), but not one worth more per byte than attention KV.
        """
        layout = self.layout
        token, state = self.token_pool, self.state_pool
        token_q, state_q = token.free_block_queue, state.free_block_queue
        victim = _lru_victim(state_q, need_state)
        if victim is not None:
            target = self._state_floor - (need_state - victim[0])
            lost = self._token_ids_lost(target)
            reserve = math.ceil(SPLIT_TOKEN_RESERVE * self._initial_token_capacity)
            if (
                target >= layout.min_state_floor
                and free_token - len(lost) >= need_token + reserve
                and _staler(token_q.oldest_lru_tick(), victim[1])
                and _movable(token, lost, keep, filed_before=victim[1])
            ):
                return target
        victim = _lru_victim(token_q, need_token)
        if victim is not None:
            capacity = token.owned_capacity + need_token - victim[0]
            target = layout.state_floor_for_token_capacity(capacity)
            lost = range(self._state_floor, target)
            if (
                target <= layout.max_state_floor
                and free_state - len(lost) >= need_state
                and _staler(state_q.oldest_lru_tick(), victim[1])
                and _movable(state, lost, keep)
            ):
                return target
        return None

    def _kept(self, keep: Iterable[KVCacheBlock], reach: Reach) -> set[tuple[int, int]]:
        """(pool, id) of the blocks a move must leave alone."""
        kept = {(id(block.pool), block.block_id) for block in keep}
        for pool in (self.token_pool, self.state_pool):
            kept |= {(id(pool), i) for i in pool.free_block_queue.spared_ids(reach)}
        return kept

    def _token_ids_lost(self, target: int) -> range:
        """Owned token ids at or above the token limit of state floor ``target``."""
        owned = self.token_pool.owned_ids
        return range(max(owned.start, self.layout.token_limit_at(target)), owned.stop)

    def _move_to(self, target: int) -> None:
        old_boundary = self.boundary_bytes
        old_token, old_state = self.token_pool.owned_ids, self.state_pool.owned_ids
        new_token = self.layout.token_ids_at(target)
        new_state = self.layout.state_ids_at(target)
        settle = None if self.coupling is None else self.coupling.settle
        if target > self._state_floor:
            grown = PoolKind.TOKEN
            gained = range(max(old_token.stop, new_token.start), new_token.stop)
            self.state_pool.resize(new_state, settle)
            self.token_pool.resize(new_token, settle)
        else:
            grown = PoolKind.STATE
            gained = range(new_state.start, old_state.start)
            self.token_pool.resize(new_token, settle)
            self.state_pool.resize(new_state, settle)
        self._state_floor = target
        logger.debug(
            "Arena boundary %d -> %d B: %s pool +%d blocks (token %d, state %d)",
            old_boundary,
            self.boundary_bytes,
            grown.value,
            len(gained),
            self.token_pool.owned_capacity,
            self.state_pool.owned_capacity,
        )


def _lru_victim(queue: ArenaFreeBlockQueue, need: int) -> tuple[int, int] | None:
    """(free blocks handed out before any LRU-filed entry, its filing tick)
    when a need of ``need`` blocks would evict such an entry, else None."""
    if not need:
        return None
    cheap = queue.num_free_before_lru(need)
    if cheap >= need:
        return None
    tick = queue.oldest_lru_tick()
    return None if tick is None else (cheap, tick)


def _staler(other: int | None, victim: int) -> bool:
    """Whether the other pool's next LRU victim (its filing tick; None when
    it has none) is older than this pool's ``victim``."""
    return other is None or other < victim


def _movable(
    pool: ArenaBlockPool,
    ids: range,
    keep: Iterable[KVCacheBlock],
    filed_before: int | None = None,
) -> bool:
    """Whether every block of ``pool`` at ``ids`` is free, unprotected, not
    in ``keep``, worth no more per byte than attention KV and, with
    ``filed_before``, clean or filed before that tick."""
    queue, blocks = pool.free_block_queue, pool.blocks
    kept = {block.block_id for block in keep if block.pool is pool}
    for i in ids:
        block = blocks[i]
        if block.ref_cnt or i in kept or queue.is_protected(block):
            return False
        if queue.policy.worth_more(i):
            return False
        if filed_before is None:
            continue
        filed = queue.filed_tick(block)
        if filed is not None and filed >= filed_before:
            return False
    return True


def _all_free(pool: ArenaBlockPool, ids: range, kept: set[tuple[int, int]]) -> bool:
    blocks = pool.blocks
    return all(blocks[i].ref_cnt == 0 and (id(pool), i) not in kept for i in ids)
