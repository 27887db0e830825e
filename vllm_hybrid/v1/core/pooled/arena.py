"""The arena: a token pool and a state pool in one byte buffer, built
together with their boundary and prefix-cache coupling.

Everyone above holds the pools through their :class:`~.coupling.PoolHandle`;
only the boundary and the coupling hold the pools themselves.
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
        #: whether the arena refused the latest new request; while it does,
        #: the token pool hands out its clean blocks next to the boundary
        #: last, and running state blocks next to it move away
        self.refusing_new = False
        token_pool.keep_boundary_clear(
            BOUNDARY_CLEAR_STATE_BLOCKS
            * layout.state_block_bytes
            // layout.token_block_bytes
        )

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
        """Owned and used blocks of both pools now (for ``/metrics``)."""
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

    def note_new_request(self, admitted: bool) -> None:
        """A request that held no blocks was ``admitted`` or refused: the
        arena refuses new requests from now on until one is admitted."""
        self.refusing_new = not admitted
        self.token_pool.clear_boundary(self.refusing_new)

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

    def allow_token_moves(self, *listeners: Callable[[int, int], None]) -> None:
        """Let the boundary move live token blocks out of the state pool's
        way (only for schedulers whose workers apply the moves); each of
        ``listeners`` hears every block's (old id, new id)."""
        self.boundary.allow_moves().listeners.extend(listeners)

    def take_token_moves(self) -> dict[int, int]:
        """Old token id -> new token id of the blocks moved since the last
        call."""
        moves = self.boundary.moves
        return moves.take() if moves is not None else {}

    def reset_prefix_cache(self) -> bool:
        """Reset both pools' prefix caches, only if every owned block is free
        (upstream's semantics)."""
        pools = (self.token_pool, self.state_pool)
        busy = {p.side.value: p.get_num_used_blocks() for p in pools}
        if any(busy.values()):
            logger.warning("Prefix cache not reset: blocks still in use %s", busy)
            return False
        for pool in pools:
            pool.reset_prefix_cache()
        return True
