"""The arena: a token pool and a state pool in one byte buffer.

The byte layout and who owns which ids are in :mod:`.spec`; the order in which
each pool hands out its free blocks is in :mod:`.policy.eviction`; where the boundary
between the pools lies and when it moves is in :mod:`.boundary`. This module
builds the two pools and their boundary, couples their prefix caches, and
checks that the bookkeeping of all of them agrees. Everyone above holds the
pools through their :class:`~.coupling.PoolHandle` (:attr:`KVArena.token_pool`,
:attr:`KVArena.state_pool`); only the boundary and the coupling hold the pools
themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.boundary import ArenaBoundary
from vllm_hybrid.v1.core.pooled.coupling import PoolHandle, PrefixCacheCoupling
from vllm_hybrid.v1.core.pooled.policy.eviction import BOUNDARY_CLEAR_STATE_BLOCKS
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PoolKind
from vllm_hybrid.v1.core.pooled.usage import ArenaUsage, PoolUsage

logger = init_logger(__name__)


class KVArena:
    """The token and state pools of one byte arena and their boundary."""

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
        break_even: float | None = None,
    ) -> None:
        self.layout = layout
        floor = layout.initial_state_floor
        #: prefix-cache coupling between the pools; None keeps them independent
        self.coupling: PrefixCacheCoupling | None = None
        common = dict(
            enable_caching=enable_caching,
            clock=count(),
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            medium=medium,
        )
        state_pool = ArenaBlockPool(
            PoolKind.STATE,
            layout.num_state_ids,
            layout.state_ids_at(floor),
            metrics_collector=state_metrics_collector,
            **common,
        )
        # upstream's KVCacheManager reads events from the token pool only
        token_pool = ArenaBlockPool(
            PoolKind.TOKEN,
            layout.num_token_ids,
            layout.token_ids_at(floor),
            metrics_collector=token_metrics_collector,
            events_of=state_pool,
            **common,
        )
        self.state_pool = PoolHandle(state_pool)
        self.token_pool = PoolHandle(token_pool)
        self.boundary = ArenaBoundary(layout, token_pool, state_pool)
        state_pool.weigh_entries(break_even)
        #: whether the arena refused the latest request that held no blocks
        #: (:meth:`note_new_request`); while it does, the token pool hands
        #: out its clean blocks next to the boundary last, and running state
        #: blocks next to it move away at edges nobody keeps
        self.refusing_new = False
        token_pool.keep_boundary_clear(
            BOUNDARY_CLEAR_STATE_BLOCKS
            * layout.state_block_bytes
            // layout.token_block_bytes
        )

    # -- read side --------------------------------------------------------

    @property
    def boundary_bytes(self) -> int:
        """First byte of the state pool; the token pool ends at or below it."""
        return self.boundary.boundary_bytes

    @property
    def state_floor(self) -> int:
        return self.boundary.state_floor

    @property
    def token_capacity(self) -> int:
        return self.token_pool.owned_capacity

    @property
    def state_capacity(self) -> int:
        return self.state_pool.owned_capacity

    def pool(self, side: PoolKind) -> PoolHandle:
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

    def note_new_request(self, admitted: bool) -> None:
        """A request that held no blocks was ``admitted`` or refused: the
        arena refuses new requests from now on until one is admitted."""
        self.refusing_new = not admitted
        self.token_pool.clear_boundary(self.refusing_new)

    # -- prefix-cache coupling ----------------------------------------------

    def couple_prefix_caches(self, token_groups: dict[int, int]) -> None:
        """Evict attention blocks no cached checkpoint needs and checkpoints
        whose attention prefix is gone (``token_groups``: block size of each
        full-attention group). Needs prefix caching and empty caches."""
        self.coupling = PrefixCacheCoupling(
            self.token_pool.pool, self.state_pool.pool, token_groups
        )
        for handle in (self.token_pool, self.state_pool):
            handle.coupling = self.coupling
        self.boundary.coupling = self.coupling

    # -- live token blocks moved off the boundary (.moves) -------------------

    def allow_token_moves(self, *listeners: Callable[[int, int], None]) -> None:
        """Let the boundary move live token blocks out of the state pool's
        way from now on; each of ``listeners`` hears every block's (old id,
        new id). Only for schedulers whose workers apply the moves
        (:meth:`take_token_moves`)."""
        self.boundary.allow_moves().listeners.extend(listeners)

    def take_token_moves(self) -> dict[int, int]:
        """Old token id -> new token id of the blocks moved since the last
        call (empty when none moved or moves are not allowed)."""
        moves = self.boundary.moves
        return moves.take() if moves is not None else {}

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
            pool.reset_prefix_cache()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests)."""
        layout = self.layout
        s_floor = self.boundary.state_floor
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
        for handle in (self.token_pool, self.state_pool):
            _check_pool(handle.pool)
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
    policy = queue.policy
    held = policy.held_from
    _require(
        set(queue.clean_at_boundary_ids())
        == {i for i in queue.clean_ids() if held is not None and i >= held},
        f"{name}: clean blocks next to the boundary filed apart from the rest",
    )
    for i in queue.cached_ids():
        block = pool.blocks[i]
        _require(block.block_hash is not None, f"{name}: cached {i} no hash")
        _require(
            queue.is_protected(block) == policy.is_proven(block),
            f"{name}: cached block {i} in the wrong LRU segment",
        )
    for i in policy.hit_counts():
        _require(pool.blocks[i].block_hash is not None, f"{name}: hits of clean {i}")
    for i, block in enumerate(pool.blocks):
        _require(block.block_id == i, f"{name}: block {block.block_id} at id {i}")
    for block in pool.blocks[1:]:
        _require(block.ref_cnt >= 0, f"{name}: block {block.block_id} ref_cnt < 0")
        if block.block_id not in owned:
            _require(
                block.ref_cnt == 0
                and block.block_hash is None
                and block.block_id not in pool.cached_block_hashes_by_block,
                f"{name}: unowned block {block.block_id} is in use or cached",
            )
