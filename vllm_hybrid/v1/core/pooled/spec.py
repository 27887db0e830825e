"""What every process of a pooled-mode engine agrees on: the arena's
geometry, the pools and the config pickled to the workers. Plain data, no
block pools; docs/pooled-mode.md ("Layout") draws the byte layout and how
ownership follows from the state floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

from vllm_hybrid.logger import init_logger

logger = init_logger(__name__)


#: Byte boundary every pool base and block stride starts on: what CUDA's
#: caching allocator gives upstream's separately allocated layers, so
#: ``.view(dtype)`` and kernels' vector loads see the bases they expect.
VIEW_ALIGNMENT_BYTES = 256


def align_up(n: int, alignment: int = VIEW_ALIGNMENT_BYTES) -> int:
    return cdiv(n, alignment) * alignment


def align_down(n: int, alignment: int = VIEW_ALIGNMENT_BYTES) -> int:
    return n // alignment * alignment


class PoolKind(str, Enum):
    """The two pools of the arena, and the end of the arena each lives at."""

    TOKEN = "token"
    STATE = "state"

    def __str__(self) -> str:
        # log lines and tables print "token"/"state" on every Python version
        return self.value

    __format__ = str.__format__


def null_region_bytes(token_block: int, state_block: int, overlap: bool) -> int:
    """Bytes at the arena's start that no owned block may use."""
    return min(token_block, state_block) if overlap else max(token_block, state_block)


@dataclass(frozen=True)
class ArenaLayout:
    """Byte geometry of the arena and the limits the boundary must respect
    (sizes in bytes, minimums in blocks of their pool)."""

    arena_bytes: int
    token_block_bytes: int
    state_block_bytes: int
    min_token_blocks: int
    min_state_blocks: int
    initial_boundary: int
    #: Let each pool's null block overlap blocks the other pool owns: only
    #: where nothing writes through a null block id (no CUDA graphs).
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
        """R: bytes ``[0, R)`` no owned block may use: both null blocks, or
        with ``null_blocks_overlap`` the smaller one."""
        return null_region_bytes(
            self.token_block_bytes, self.state_block_bytes, self.null_blocks_overlap
        )

    @property
    def first_token_id(self) -> int:
        """Lowest token id clear of the null region."""
        return cdiv(self.null_region_bytes, self.token_block_bytes)

    @property
    def state_offset(self) -> int:
        """Byte where the state pool's id 0 starts: with overlapping null
        blocks, aligned to the arena's top so that no tail is lost; else 0."""
        if self.null_blocks_overlap:
            return self.arena_bytes % self.state_block_bytes
        return 0

    @property
    def first_state_id(self) -> int:
        """Lowest state id clear of the null region."""
        clear = max(0, self.null_region_bytes - self.state_offset)
        return max(1, cdiv(clear, self.state_block_bytes))

    def token_limit_at(self, state_floor: int) -> int:
        """End (exclusive) of the token ids owned at ``state_floor``."""
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
        return max(self.first_state_id, cdiv(above, self.state_block_bytes))

    @property
    def min_state_floor(self) -> int:
        """Lowest state floor: the token pool keeps ``min_token_blocks``."""
        return self.state_floor_for_token_capacity(self.min_token_blocks)

    @property
    def max_state_floor(self) -> int:
        """Highest state floor: the state pool keeps ``min_state_blocks``."""
        return self.num_state_ids - self.min_state_blocks

    def boundary_at(self, state_floor: int) -> int:
        """Byte where the state pool begins when its lowest id is ``state_floor``."""
        return self.state_offset + state_floor * self.state_block_bytes

    @property
    def initial_state_floor(self) -> int:
        above = max(0, self.initial_boundary - self.state_offset)
        return max(self.first_state_id, above // self.state_block_bytes)


@dataclass(frozen=True)
class KVPoolSpec:
    """One block pool of the arena, as every process sees it."""

    #: TOKEN (grows with sequence length) or STATE (O(1) per request).
    kind: PoolKind
    #: KV cache group ids served by this pool.
    group_ids: tuple[int, ...]
    #: Bytes of one block id (one page of every layer of its groups).
    block_bytes: int
    #: Size of the pool's block-id space (its view over the whole arena).
    num_blocks: int


@dataclass
class PooledKVCacheConfig(KVCacheConfig):
    """A ``KVCacheConfig`` whose groups live in separate pools of one arena;
    ``num_blocks`` stays the token pool's id space for upstream code."""

    pools: list[KVPoolSpec] = field(default_factory=list)
    #: Geometry of the arena; the scheduler's KVArena is built from it.
    arena: ArenaLayout | None = None
    #: State blocks one running request holds at most (for capacity figures).
    max_state_blocks_per_request: int = 1
    #: Keep each request's last decode checkpoint (turn-end retention).
    retain_turn_ends: bool = True
    #: Let live token blocks move off the arena's boundary (see :mod:`.moves`).
    token_moves: bool = True
    #: Tokens between prefill checkpoints (0: none; :mod:`.policy.positions`).
    prefill_checkpoint_interval: int = 0
    #: Tokens between prefill checkpoint anchors (0: none).
    prefill_checkpoint_anchor: int = 0

    @property
    def layout(self) -> ArenaLayout:
        assert self.arena is not None, "pooled config without an arena layout"
        return self.arena

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena (the single backing allocation per worker)."""
        return self.layout.arena_bytes

    @property
    def null_region_bytes(self) -> int:
        return self.layout.null_region_bytes

    @property
    def null_blocks_overlap(self) -> bool:
        return self.layout.null_blocks_overlap

    @property
    def initial_boundary(self) -> int:
        """Initial token/state boundary in bytes."""
        return self.layout.boundary_at(self.layout.initial_state_floor)

    def pool_of_group(self, group_id: int) -> KVPoolSpec:
        for pool in self.pools:
            if group_id in pool.group_ids:
                return pool
        raise KeyError(f"KV cache group {group_id} is in no pool")

    def pool_by_kind(self, kind: PoolKind) -> KVPoolSpec:
        for pool in self.pools:
            if pool.kind == kind:
                return pool
        raise KeyError(f"no {kind} pool")

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks of the pool whose view ``tensor`` is, which every worker's
        ``allocate_kv_cache`` shapes its views with (upstream's is the one
        ``num_blocks``). Logs the worker's arena once per process."""
        layer = tensor.layers[0]
        for group_id, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_names:
                logger.info_once(
                    "vllm-hybrid pooled KV arena on this worker: %s",
                    self.describe_pools(),
                    scope="process",
                )
                return self.pool_of_group(group_id).num_blocks
        raise KeyError(f"layer {layer} is in no KV cache group")

    def describe_pools(self) -> str:
        return (
            "; ".join(
                f"{pool.kind} pool {pool.num_blocks} ids x {pool.block_bytes} B"
                for pool in self.pools
            )
            + f"; arena {self.arena_bytes} B"
        )
