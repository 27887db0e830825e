"""The arena: a token pool and a state pool and the boundary between them.

The byte layout and who owns which ids are in :mod:`.spec`; this module moves
the boundary and keeps both pools consistent with it.

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

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.coupling import PrefixCacheCoupling
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PoolKind
from vllm_hybrid.v1.core.pooled.usage import ArenaUsage, PoolUsage

logger = init_logger(__name__)


@dataclass(frozen=True)
class BoundaryMove:
    """One boundary move, for logs, metrics and zeroing of gained blocks."""

    old_boundary: int
    new_boundary: int
    grown: PoolKind
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
        self.coupling: PrefixCacheCoupling | None = None
        common = dict(
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            medium=medium,
        )
        self.token_pool = ArenaBlockPool(
            self,
            PoolKind.TOKEN,
            layout.num_token_ids,
            layout.token_ids_at(self._state_floor),
            metrics_collector=token_metrics_collector,
            **common,
        )
        self.state_pool = ArenaBlockPool(
            self,
            PoolKind.STATE,
            layout.num_state_ids,
            layout.state_ids_at(self._state_floor),
            metrics_collector=state_metrics_collector,
            **common,
        )

    # -- read side --------------------------------------------------------

    @property
    def boundary_bytes(self) -> int:
        """First byte of the state pool; the token pool ends at or below it."""
        return self.layout.boundary_at(self._state_floor)

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

    def pool(self, side: PoolKind) -> ArenaBlockPool:
        return self.token_pool if side is PoolKind.TOKEN else self.state_pool

    def usage(self) -> ArenaUsage:
        """Owned and used blocks of both pools now (what ``/metrics`` and the
        benchmarks report)."""
        layout = self.layout
        pools = tuple(
            PoolUsage(
                kind.value,
                block_bytes,
                self.pool(kind).owned_capacity,
                self.pool(kind).get_num_used_blocks(),
            )
            for kind, block_bytes in (
                (PoolKind.TOKEN, layout.token_block_bytes),
                (PoolKind.STATE, layout.state_block_bytes),
            )
        )
        return ArenaUsage(layout.arena_bytes, self.boundary_bytes, pools)

    def coupled_evictions(self) -> int | None:
        """Blocks evicted because the other pool made them useless; None
        without coupling."""
        if self.coupling is None:
            return None
        return sum(self.coupling.evictions.values())

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
        self,
        need_token: int,
        need_state: int,
        keep: Iterable[KVCacheBlock] = (),
        spare_protected: bool = False,
    ) -> bool:
        """Make both pools have at least that many free blocks, moving the
        boundary if needed; all-or-nothing, returns whether it succeeded.

        With ``spare_protected`` it succeeds only without handing out or
        giving away any block of a pool's protected segment (entries that
        served several prefix hits; see :class:`ArenaFreeBlockQueue`).
        """
        target = self._plan(need_token, need_state, keep, spare_protected)
        if target is None:
            return False
        if target != self._state_floor:
            self._move_to(target)
        return True

    def ensure_side(self, side: PoolKind, need: int) -> bool:
        """:meth:`ensure` for one pool only (the other needs nothing)."""
        if side is PoolKind.TOKEN:
            return self.ensure(need, 0)
        return self.ensure(0, need)

    def _plan(
        self,
        need_token: int,
        need_state: int,
        keep: Iterable[KVCacheBlock] = (),
        spare_protected: bool = False,
    ) -> int | None:
        """State floor that satisfies both needs, or None if none does.

        ``keep`` are free cached blocks about to be reused (prefix hits not
        yet touched): a move must not evict them or hand their bytes over.
        With ``spare_protected`` protected free blocks count as neither free
        nor movable.
        """
        kept = {(id(block.pool), block.block_id) for block in keep}
        if spare_protected:
            kept |= self._protected_keys(self.token_pool)
            kept |= self._protected_keys(self.state_pool)
        free_token = self._free(self.token_pool, spare_protected)
        free_state = self._free(self.state_pool, spare_protected)
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

    @staticmethod
    def _free(pool: ArenaBlockPool, spare_protected: bool) -> int:
        free = pool.get_num_free_blocks()
        if spare_protected:
            free -= pool.free_block_queue.num_protected_blocks
        return free

    @staticmethod
    def _protected_keys(pool: ArenaBlockPool) -> set[tuple[int, int]]:
        return {(id(pool), i) for i in pool.free_block_queue.protected_ids()}

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
            grown = PoolKind.TOKEN
            lost = range(old_state_ids.start, new_state_ids.start)
            gained = range(
                max(old_token_ids.stop, new_token_ids.start), new_token_ids.stop
            )
            self.state_pool._give_away(lost)
            self.state_pool.owned_ids = new_state_ids
            self.token_pool.owned_ids = new_token_ids
            self.token_pool._take_over(gained)
        else:
            grown = PoolKind.STATE
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
        self.coupling = PrefixCacheCoupling(
            self.token_pool, self.state_pool, token_groups
        )

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
        if self.coupling is not None:
            self.coupling.check()


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
        _require(
            queue.is_protected(pool.blocks[i]) == pool.is_proven(pool.blocks[i]),
            f"{name}: cached block {i} in the wrong LRU segment",
        )
    for i in pool.hit_counts():
        _require(pool.blocks[i].block_hash is not None, f"{name}: hits of clean {i}")
    for block in pool.blocks[1:]:
        _require(block.ref_cnt >= 0, f"{name}: block {block.block_id} ref_cnt < 0")
        if block.block_id not in owned:
            _require(
                block.ref_cnt == 0
                and block.block_hash is None
                and block.block_id not in pool.cached_block_hashes_by_block,
                f"{name}: unowned block {block.block_id} is in use or cached",
            )
