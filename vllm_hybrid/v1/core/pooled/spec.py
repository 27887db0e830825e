"""What every process of a pooled-mode engine agrees on: the arena's geometry.

Pooled mode gives a hybrid model one block pool per page kind instead of
upstream's single pool with one page size:

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

This module is the bottom layer of :mod:`vllm_hybrid.v1.core.pooled`: plain
data (:class:`ArenaLayout`, :class:`KVPoolSpec`, :class:`PooledKVCacheConfig`,
which is pickled to workers), no block pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

from vllm_hybrid.logger import init_logger

logger = init_logger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: Byte boundary every pool base and every per-layer view of a pooled arena
#: starts on. Views are reinterpreted as bf16/float32 state and KV tensors
#: (``.view(dtype)`` needs the storage offset divisible by the element size)
#: and kernels issue vector loads that assume aligned bases; CUDA's caching
#: allocator hands out 256-byte aligned blocks, so this matches what a
#: kernel sees for upstream's separately allocated layers.
VIEW_ALIGNMENT_BYTES = 256


def align_up(n: int, alignment: int = VIEW_ALIGNMENT_BYTES) -> int:
    return _cdiv(n, alignment) * alignment


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
    """A ``KVCacheConfig`` whose groups live in separate pools of one arena.

    ``num_blocks`` keeps meaning the token pool's id space for upstream code
    that reads it (zeroing, logs, watermark); per-pool sizes are in ``pools``.
    Being a dataclass subclass, it survives deepcopy and pickling to workers.
    """

    pools: list[KVPoolSpec] = field(default_factory=list)
    #: Geometry of the arena (block sizes, floors, initial boundary, null
    #: blocks); the scheduler's KVArena is built from exactly this.
    arena: ArenaLayout | None = None
    #: State blocks one running request holds at most (for capacity figures).
    max_state_blocks_per_request: int = 1
    #: Keep each request's last decode checkpoint (turn-end retention).
    retain_turn_ends: bool = True
    #: Let live token blocks move off the arena's boundary (see :mod:`.moves`).
    token_moves: bool = True
    #: Tokens between the states kept during a prefill (0: none); see
    #: :mod:`.policy`.
    prefill_checkpoint_interval: int = 0
    #: Tokens between the prefill checkpoints kept in plain LRU order (0:
    #: none); see :mod:`.policy`.
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
        """Blocks of the pool whose view ``tensor`` is.

        Overrides upstream's ``KVCacheConfig.num_blocks_of``, which every
        worker's ``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) calls to
        shape each layer's view of its tensor: upstream's answer is the one
        shared ``num_blocks``, here each pool has its own id space. Logs the
        worker's view of the arena once in every worker process (tensor
        ranks and pipeline stages alike: a stage's view has its own layers).
        """
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
