"""Tests of the pooled-mode arena: layout, free order, boundary moves.

Most tests use ``SMALL``: a 100 B arena, 4 B token blocks and 10 B state
blocks, boundary at 50 B. Null region [0, 10): token ids 1 and 2 are
reserved, the token pool owns ids 3..11 (9 blocks, id 12 would cross 50 B) and
the state pool owns ids 5..9 (5 blocks). Floors: 2 blocks each, so the state
floor stays within [2, 8].
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pooled_invariants import (
    cached_ids,
    can_allocate,
    check_invariants,
    clean_ids,
    ensure,
    protected_ids,
)
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)

from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.coordinator import InPlaceView
from vllm_hybrid.v1.core.pooled.free_queue import ArenaFreeBlockQueue
from vllm_hybrid.v1.core.pooled.policy.eviction import (
    PROTECT_AFTER_HITS,
    Place,
    Reach,
)
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PoolKind

SMALL = ArenaLayout(
    arena_bytes=100,
    token_block_bytes=4,
    state_block_bytes=10,
    min_token_blocks=2,
    min_state_blocks=2,
    initial_boundary=50,
)
GROUP = {PoolKind.TOKEN: 0, PoolKind.STATE: 1}


def make_arena(layout: ArenaLayout = SMALL, events: bool = False) -> KVArena:
    return KVArena(
        layout,
        enable_caching=True,
        hash_block_size=16,
        enable_kv_cache_events=events,
    )


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def key(pool: ArenaBlockPool, name: bytes):
    return make_block_hash_with_group_id(BlockHash(name), GROUP[pool.side])


def cache(pool: ArenaBlockPool, block: KVCacheBlock, name: bytes) -> None:
    """Give a held block a prefix-cache hash, as cache_full_blocks would."""
    pool._insert_block_hash(key(pool, name), block, num_tokens=16)


def free_order(pool: ArenaBlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


def test_layout_math_realistic_sizes():
    layout = ArenaLayout(1_000_000, 16_384, 268_288, 0, 0, 536_576)
    assert layout.num_token_ids == 61  # 61 * 16384 = 999_424
    assert layout.num_state_ids == 3  # 3 * 268288 = 804_864
    assert layout.null_region_bytes == 268_288
    assert layout.first_token_id == 17  # 16 * 16384 = 262_144 < 268_288
    assert layout.first_state_id == 1
    assert layout.initial_state_floor == 2
    assert layout.token_ids_at(2) == range(17, 32)  # 32 * 16384 = 524_288
    assert layout.state_ids_at(2) == range(2, 3)
    assert (layout.min_state_floor, layout.max_state_floor) == (1, 3)

    arena = make_arena(layout)
    assert arena.boundary_bytes == 536_576
    assert (arena.token_capacity, arena.state_capacity) == (15, 1)
    assert arena.token_pool.num_gpu_blocks == len(arena.token_pool.blocks) == 61
    assert arena.state_pool.num_gpu_blocks == len(arena.state_pool.blocks) == 3
    assert arena.token_pool.get_num_free_blocks() == 15
    assert arena.state_pool.get_num_free_blocks() == 1
    check_invariants(arena)


def test_layout_state_block_smaller_than_token_block():
    layout = ArenaLayout(100, 10, 4, 1, 1, 52)
    assert (layout.num_token_ids, layout.num_state_ids) == (10, 25)
    assert layout.first_token_id == 1
    assert layout.first_state_id == 3  # bytes 4..12 overlap [0, 10)
    assert layout.initial_state_floor == 13  # 52 B rounds down to 13 * 4
    arena = make_arena(layout)
    assert arena.token_pool.owned_ids == range(1, 5)  # 5 * 10 = 50 <= 52
    assert arena.state_pool.owned_ids == range(13, 25)
    assert arena.boundary_bytes == 52


def test_small_layout_ownership():
    arena = make_arena()
    assert SMALL.first_token_id == 3
    assert arena.token_pool.owned_ids == range(3, 12)
    assert arena.state_pool.owned_ids == range(5, 10)
    assert (SMALL.min_state_floor, SMALL.max_state_floor) == (2, 8)
    assert (
        SMALL.initial_state_floor
        == ArenaLayout(100, 4, 10, 2, 2, 59).initial_state_floor
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arena_bytes=0), "arena_bytes must be positive"),
        (dict(min_state_blocks=-1), "must not be negative"),
        (dict(arena_bytes=10), "null region alone takes 10 B"),
        (dict(min_token_blocks=10, min_state_blocks=5), "cannot hold the minimums"),
        (dict(initial_boundary=90), "must lie in [20, 90) B"),
        (dict(initial_boundary=15), "must lie in [20, 90) B"),
    ],
)
def test_layout_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(SMALL, **kwargs)


# ---------------------------------------------------------------------------
# Free queue order
# ---------------------------------------------------------------------------


def test_allocation_order_token_lowest_state_highest():
    arena = make_arena()
    tok, st_ = arena.token_pool, arena.state_pool
    assert ids(tok.get_new_blocks(3)) == [3, 4, 5]
    assert ids(st_.get_new_blocks(2)) == [9, 8]
    # Freed clean blocks go back by position, not LIFO as upstream.
    tok.free_blocks([tok.blocks[4]])
    st_.free_blocks([st_.blocks[9]])
    assert free_order(tok) == [4, 6, 7, 8, 9, 10, 11]
    assert free_order(st_) == [9, 7, 6, 5]
    assert ids(tok.get_new_blocks(2)) == [4, 6]
    assert ids(st_.get_new_blocks(1)) == [9]
    check_invariants(arena)


def test_cached_blocks_after_clean_ones_in_lru_order():
    arena = make_arena()
    tok = arena.token_pool
    held = tok.get_new_blocks(9)
    for block, name in zip(held, b"abcdefghi", strict=True):
        if block.block_id in (5, 7, 9):
            cache(tok, block, bytes([name]))
    # Freed in this order, cached blocks are 9, then 5, then 7 in LRU order.
    tok.free_blocks([tok.blocks[9], tok.blocks[10], tok.blocks[5]])
    tok.free_blocks([tok.blocks[4], tok.blocks[7]])
    assert clean_ids(tok.free_block_queue) == [4, 10]
    assert cached_ids(tok.free_block_queue) == [9, 5, 7]
    assert free_order(tok) == [4, 10, 9, 5, 7]
    assert tok.get_usage() == pytest.approx(4 / 9)

    got = tok.get_new_blocks(4)
    assert ids(got) == [4, 10, 9, 5]
    assert all(b.block_hash is None for b in got)  # evicted on reuse
    assert tok.get_cached_block(BlockHash(b"g"), [0]) is None  # was block 9
    assert tok.get_cached_block(BlockHash(b"c"), [0]) is None  # was block 5
    assert tok.get_cached_block(BlockHash(b"e"), [0]) == [tok.blocks[7]]
    check_invariants(arena)


def test_prepend_n_puts_cached_blocks_at_lru_head():
    pool = make_arena().token_pool
    blocks = pool.get_new_blocks(4)
    for block, name in zip(blocks, (b"w", b"x", b"y", b"z"), strict=True):
        cache(pool, block, name)
    queue = pool.free_block_queue
    queue.append_n([blocks[0], blocks[1]])
    queue.prepend_n([blocks[2], blocks[3]])
    assert cached_ids(queue) == [5, 6, 3, 4]
    queue.remove(blocks[2])
    assert cached_ids(queue) == [6, 3, 4]
    assert queue.popleft().block_id == 7  # clean ones still go first
    assert [queue.popleft().block_id for _ in range(5)] == [8, 9, 10, 11, 6]


def _state_pool_freed(order: list[int], window: int) -> ArenaBlockPool:
    """The small arena's state pool (ids 5..9) with every block cached and
    freed in ``order``, picking among its ``window`` oldest."""
    pool = make_arena().state_pool
    held = {b.block_id: b for b in pool.get_new_blocks(5)}
    for bid, block in held.items():
        cache(pool, block, bytes([bid]))
    pool.free_block_queue.window = window
    pool.free_blocks([held[bid] for bid in order])
    return pool


@pytest.mark.parametrize(
    ("window", "handed_out"),
    [(1, [5, 9, 6, 8, 7]), (2, [9, 6, 8, 7, 5]), (8, [9, 8, 7, 6, 5])],
)
def test_state_pool_hands_out_the_farthest_of_its_oldest_cached_blocks(
    window, handed_out
):
    """Freed as 5, 9, 6, 8, 7: plain LRU with a window of one; with a window
    the highest id (farthest from the boundary below the state pool) among
    the oldest goes first, so the ids next to the boundary stay free."""
    pool = _state_pool_freed([5, 9, 6, 8, 7], window)
    assert free_order(pool) == handed_out
    assert ids(pool.get_new_blocks(5)) == handed_out


def test_entries_filed_at_the_head_still_go_first():
    """Speculative entries placed at the head (5 and 6) go before older
    entries farther from the boundary; the window orders them among
    themselves."""
    pool = _state_pool_freed([5, 6, 7, 8, 9], 8)
    queue = pool.free_block_queue
    assert free_order(pool) == [9, 8, 7, 6, 5]
    queue.place(pool.blocks[5], Place.HEAD)
    queue.place(pool.blocks[6], Place.HEAD)
    assert free_order(pool) == [6, 5, 9, 8, 7]
    assert ids(pool.get_new_blocks(3)) == [6, 5, 9]
    # moved to the tail, an entry joins the rest again
    queue.place(pool.blocks[7], Place.TAIL)
    assert free_order(pool) == [8, 7]


def test_the_token_pool_keeps_plain_lru():
    """Upstream frees a request's blocks last block first, so a cached prefix
    is evicted from its end; the token pool must not pick by position."""
    pool = make_arena().token_pool
    assert pool.free_block_queue.window == 1
    held = pool.get_new_blocks(3)
    for block, name in zip(held, (b"a", b"b", b"c"), strict=True):
        cache(pool, block, name)
    pool.free_blocks(held[::-1])
    assert cached_ids(pool.free_block_queue) == ids(held[::-1])


def test_queue_heap_compaction_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(300)]
    queue = ArenaFreeBlockQueue(blocks[1:], low_ids_first=False)
    for block in blocks[100:299]:
        queue.remove(block)
    assert len(queue._clean._heap) <= 2 * queue.num_free_blocks + 64
    assert queue.num_free_blocks == 100
    assert [queue.popleft().block_id for _ in range(3)] == [299, 99, 98]
    with pytest.raises(RuntimeError, match="not free"):
        queue.remove(blocks[299])


def test_evict_by_id_refiles_free_block_as_clean():
    pool = make_arena().token_pool
    blocks = pool.get_new_blocks(9)
    cache(pool, blocks[-1], b"t")  # id 11
    pool.free_blocks(blocks[::-1])
    assert free_order(pool) == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert cached_ids(pool.free_block_queue) == [11]
    pool.evict_blocks({11, 0, 1, 20})  # null, reserved, unowned: no-ops
    assert cached_ids(pool.free_block_queue) == []
    assert pool.get_cached_block(BlockHash(b"t"), [0]) is None


def test_touch_removes_cached_free_block_and_iter_blocks_after():
    pool = make_arena().token_pool
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks[0], b"p")
    pool.free_blocks(blocks)
    queue = pool.free_block_queue
    assert ids(queue.iter_blocks_after(None))[:2] == [4, 5]
    assert ids(queue.iter_blocks_after(pool.blocks[11])) == [3]
    hit = pool.get_cached_block(BlockHash(b"p"), [0])
    assert hit == [pool.blocks[3]]
    pool.touch(hit)
    assert pool.blocks[3].ref_cnt == 1
    assert pool.get_num_free_blocks() == 8
    assert list(queue.iter_blocks_after(pool.blocks[3])) == []


def test_cache_full_blocks_with_fake_request():
    pool = make_arena().token_pool
    request = SimpleNamespace(block_hashes=[BlockHash(b"r0"), BlockHash(b"r1")])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 16, kv_cache_group_id=0)
    assert pool.get_cached_block(BlockHash(b"r1"), [0]) == [blocks[1]]
    pool.free_blocks(reversed(blocks))
    assert cached_ids(pool.free_block_queue) == [4, 3]
    pool.touch(pool.get_cached_block(BlockHash(b"r0"), [0]))
    assert cached_ids(pool.free_block_queue) == [4]


# ---------------------------------------------------------------------------
# Boundary moves
# ---------------------------------------------------------------------------


def test_token_pool_grows_on_demand():
    arena = make_arena()
    assert can_allocate(arena.boundary, 14, 0)
    assert arena.boundary_bytes == 50  # can_allocate changes nothing
    assert arena.token_pool.owned_ids == range(3, 12)
    assert arena.state_pool.owned_ids == range(5, 10)
    with pytest.raises(ValueError, match="Cannot get 14 free blocks"):
        arena.token_pool.get_new_blocks(14)  # a pool never moves the boundary
    assert arena.boundary_bytes == 50
    assert ensure(arena.boundary, 14, 0)
    got = arena.token_pool.get_new_blocks(14)
    assert ids(got) == list(range(3, 17))
    # 14 blocks end at 68 B: the state floor rounds up to 70 B (id 7). The
    # token pool gained ids 12-16, the state pool gave up 5-6.
    assert arena.boundary_bytes == 70
    assert arena.token_pool.owned_ids == range(3, 17)
    assert arena.state_pool.owned_ids == range(7, 10)
    check_invariants(arena)


def test_state_pool_grows_on_demand_and_back():
    arena = make_arena()
    assert ensure(arena.boundary, 0, 7)
    assert arena.boundary_bytes == 30
    assert arena.token_pool.owned_ids == range(3, 7)  # 7 * 4 = 28 <= 30
    assert arena.state_pool.owned_ids == range(3, 10)
    assert free_order(arena.state_pool) == [9, 8, 7, 6, 5, 4, 3]
    assert ensure(arena.boundary, 9, 0)
    assert arena.boundary_bytes == 50
    assert arena.token_pool.owned_ids == range(3, 12)
    assert arena.state_pool.owned_ids == range(5, 10)
    check_invariants(arena)


def test_min_floors_are_respected():
    arena = make_arena()
    assert not can_allocate(arena.boundary, 0, 9)  # token pool would keep 1 < 2 blocks
    assert not ensure(arena.boundary, 0, 9)
    assert ensure(arena.boundary, 0, 8)
    assert arena.token_pool.owned_ids == range(3, 5)  # exactly the floor
    assert not ensure(arena.boundary, 18, 0)  # state pool would keep 1 < 2 blocks
    assert ensure(arena.boundary, 17, 0)  # state floor 8: 80 B, token ids 3..19
    assert (arena.token_capacity, arena.state_capacity) == (17, 2)
    with pytest.raises(ValueError, match="Cannot get 18 free blocks from the pool"):
        arena.token_pool.get_new_blocks(18)
    check_invariants(arena)


def test_other_pool_keeps_its_need():
    arena = make_arena()
    assert can_allocate(arena.boundary, 14, 3)  # state floor 7 leaves 3 state blocks
    assert not can_allocate(arena.boundary, 14, 4)
    assert not can_allocate(arena.boundary, 10, 6)  # both short: no move helps
    assert ensure(arena.boundary, 14, 3)
    assert arena.state_pool.get_num_free_blocks() == 3


def snapshot(arena: KVArena):
    return (
        arena.boundary_bytes,
        [
            (
                free_order(pool),
                tuple(b.ref_cnt for b in pool.blocks),
                tuple(b.block_hash for b in pool.blocks),
            )
            for pool in (arena.token_pool, arena.state_pool)
        ],
    )


def test_live_token_block_at_boundary_pins_it():
    arena = make_arena()
    tok = arena.token_pool
    held = tok.get_new_blocks(9)
    cache(tok, held[7], b"c")  # id 10, cached and free: evictable
    tok.free_blocks(held[:8])  # keep id 11 live
    before = snapshot(arena)
    assert not can_allocate(arena.boundary, 0, 6)  # would need token ids 10, 11
    assert not ensure(arena.boundary, 0, 6)
    with pytest.raises(ValueError, match="Cannot get 6 free blocks from the pool"):
        arena.state_pool.get_new_blocks(6)
    assert snapshot(arena) == before  # all-or-nothing
    assert tok.get_cached_block(BlockHash(b"c"), [0]) == [tok.blocks[10]]

    tok.free_blocks([held[8]])
    assert ensure(arena.boundary, 0, 6)
    assert arena.boundary_bytes == 40
    assert tok.get_cached_block(BlockHash(b"c"), [0]) is None
    check_invariants(arena)


def test_live_state_block_at_boundary_pins_it():
    arena = make_arena()
    st_ = arena.state_pool
    held = st_.get_new_blocks(5)
    assert ids(held) == [9, 8, 7, 6, 5]
    st_.free_blocks(held[:4])  # keep id 5, the one at the boundary
    before = snapshot(arena)
    assert not ensure(arena.boundary, 10, 0)
    assert snapshot(arena) == before
    st_.free_blocks(held[4:])
    assert ensure(arena.boundary, 10, 0)
    assert arena.boundary_bytes == 60


def test_evicting_cached_block_in_the_way_emits_block_removed():
    arena = make_arena(events=True)
    st_ = arena.state_pool
    held = st_.get_new_blocks(5)
    cache(st_, held[4], b"s5")  # id 5, at the boundary
    st_.free_blocks(held)
    assert cached_ids(st_.free_block_queue) == [5]
    assert st_.take_events() == []

    assert ensure(arena.boundary, 10, 0)
    assert arena.boundary_bytes == 60
    events = st_.take_events()
    assert events == [
        BlockRemoved(
            block_hashes=[maybe_convert_block_hash(BlockHash(b"s5"))],
            medium=st_.medium,
            group_idx=1,
        )
    ]
    assert st_.get_cached_block(BlockHash(b"s5"), [1]) is None
    assert arena.token_pool.take_events() == []
    assert arena.token_pool.owned_ids == range(3, 15)
    check_invariants(arena)


def test_reset_prefix_cache_only_when_everything_is_free():
    arena = make_arena(events=True)
    tok, st_ = arena.token_pool, arena.state_pool
    t_blocks, s_blocks = tok.get_new_blocks(2), st_.get_new_blocks(1)
    cache(tok, t_blocks[0], b"a")
    cache(st_, s_blocks[0], b"b")
    tok.free_blocks(t_blocks)
    assert not arena.reset_prefix_cache()  # state block 9 still held
    assert tok.get_cached_block(BlockHash(b"a"), [0]) == [t_blocks[0]]
    assert tok.reset_prefix_cache()  # the token pool alone is all free
    assert tok.get_cached_block(BlockHash(b"a"), [0]) is None
    assert not st_.reset_prefix_cache()

    st_.free_blocks(s_blocks)
    assert cached_ids(st_.free_block_queue) == [9]
    assert arena.reset_prefix_cache()
    assert st_.get_cached_block(BlockHash(b"b"), [1]) is None
    assert cached_ids(st_.free_block_queue) == []
    assert free_order(st_) == [9, 8, 7, 6, 5]
    # one AllBlocksCleared per pool reset (token twice, state once); the
    # token pool hands out the state pool's events too
    assert [type(e) for e in tok.take_events()] == [AllBlocksCleared] * 3
    assert st_.take_events() == []
    check_invariants(arena)


def test_usage_counts_owned_blocks_only():
    arena = make_arena()
    arena.token_pool.get_new_blocks(3)
    assert arena.token_pool.get_usage() == pytest.approx(3 / 9)
    assert ensure(arena.boundary, 0, 7)  # token pool now owns 4 blocks, 3 used
    assert arena.token_pool.get_usage() == pytest.approx(3 / 4)
    assert arena.state_pool.get_usage() == 0.0


def test_free_blocks_routes_mixed_list_to_owning_pools():
    arena = make_arena()
    t_blocks = arena.token_pool.get_new_blocks(2)
    s_blocks = arena.state_pool.get_new_blocks(2)
    arena.token_pool.free_blocks(s_blocks + t_blocks)
    assert arena.token_pool.get_num_free_blocks() == 9
    assert arena.state_pool.get_num_free_blocks() == 5
    check_invariants(arena)


# ---------------------------------------------------------------------------
# Property test
# ---------------------------------------------------------------------------


def oracle_floors(
    arena: KVArena, need_token: int, need_state: int, spare_protected: bool = False
) -> list[int]:
    """State floors that satisfy both needs, computed from bytes directly;
    with ``spare_protected`` a protected free block counts as held."""
    lay = arena.layout
    tb, sb = lay.token_block_bytes, lay.state_block_bytes
    # overlapping null blocks keep only the smaller block clear, and align
    # the state view to the arena's top
    null = min(tb, sb) if lay.null_blocks_overlap else max(tb, sb)
    off = lay.arena_bytes % sb if lay.null_blocks_overlap else 0
    tok, st_ = arena.token_pool, arena.state_pool

    def held(block: KVCacheBlock) -> bool:
        queue = block.pool.free_block_queue
        return block.ref_cnt > 0 or (spare_protected and queue.is_protected(block))

    def token_owned(t: int, floor: int) -> bool:
        return t * tb >= null and (t + 1) * tb <= off + floor * sb

    def state_owned(s: int, floor: int) -> bool:
        start = off + s * sb
        return s >= max(floor, 1) and start >= null and start + sb <= lay.arena_bytes

    floors = []
    lowest = max(1, -(-max(0, null - off) // sb))
    for floor in range(lowest, lay.num_state_ids + 1):
        t_new = [t for t in range(1, lay.num_token_ids) if token_owned(t, floor)]
        s_new = [s for s in range(1, lay.num_state_ids) if state_owned(s, floor)]
        if len(t_new) < lay.min_token_blocks or len(s_new) < lay.min_state_blocks:
            continue
        leaving = [tok.blocks[t] for t in tok.owned_ids if t not in t_new] + [
            st_.blocks[s] for s in st_.owned_ids if s not in s_new
        ]
        if any(held(b) for b in leaving):
            continue
        free_t = sum(1 for t in t_new if not held(tok.blocks[t]))
        free_s = sum(1 for s in s_new if not held(st_.blocks[s]))
        if free_t >= need_token and free_s >= need_state:
            floors.append(floor)
    return floors


def map_entries(pool: ArenaBlockPool, block_ids) -> int:
    """Prefix-cache entries pointing at the given blocks."""
    count = 0
    for i in block_ids:
        block = pool.blocks[i]
        keys = [block.block_hash] if block.block_hash is not None else []
        keys += pool.cached_block_hashes_by_block.get(i, ())
        count += sum(pool.cached_block_hash_to_block.contain(k, i) for k in keys)
    return count


class ArenaMachine(RuleBasedStateMachine):
    """Random allocate/free/cache/hit/evict/preempt/reset sequences against
    a reference count model and a brute-force feasibility oracle."""

    def __init__(self) -> None:
        super().__init__()
        self.arena: KVArena | None = None
        self.requests: dict[int, list[KVCacheBlock]] = {}
        self.next_req = 0
        self.next_hash = 0

    @initialize(data=st.data())
    def build(self, data):
        tb = data.draw(st.integers(1, 8), label="tb")
        sb = data.draw(st.integers(1, 24), label="sb")
        min_t = data.draw(st.integers(0, 3), label="min_token")
        min_s = data.draw(st.integers(0, 3), label="min_state")
        null = max(tb, sb)
        low = null + (min_t + 1) * tb + (min_s + 2) * sb
        total = low + data.draw(st.integers(0, 200), label="extra")
        overlap = data.draw(st.booleans(), label="null_blocks_overlap")
        offset = total % sb if overlap else 0
        probe = ArenaLayout(
            total, tb, sb, min_t, min_s, offset + (total // sb - min_s) * sb, overlap
        )
        floor = data.draw(
            st.integers(probe.min_state_floor, probe.max_state_floor), label="floor"
        )
        slack = data.draw(st.integers(0, sb - 1), label="slack")
        boundary = offset + floor * sb + slack
        layout = ArenaLayout(total, tb, sb, min_t, min_s, boundary, overlap)
        assert layout.state_offset == offset
        assert layout.initial_state_floor == floor
        self.events = data.draw(st.booleans(), label="events")
        self.arena = make_arena(layout, events=self.events)
        clear = data.draw(st.integers(0, 6), label="boundary_clear_ids")
        self.arena.token_pool.keep_boundary_clear(clear)

    # -- helpers ------------------------------------------------------------

    def pools(self) -> tuple[ArenaBlockPool, ArenaBlockPool]:
        assert self.arena is not None
        return self.arena.token_pool, self.arena.state_pool

    def pick_request(self, data, create: bool) -> int:
        if create or not self.requests:
            self.next_req += 1
            self.requests[self.next_req] = []
            return self.next_req
        return data.draw(st.sampled_from(sorted(self.requests)), label="req")

    def drain_events(self) -> None:
        for pool in self.pools():
            pool.take_events()

    def cached_keys(self) -> list[tuple[ArenaBlockPool, object]]:
        return [
            (pool, k)
            for pool in self.pools()
            for k in pool.cached_block_hash_to_block._cache
        ]

    def held_single_state_blocks(self) -> list[tuple[int, KVCacheBlock]]:
        return [
            (r, b)
            for r, bs in self.requests.items()
            for b in bs
            if b.pool is self.arena.state_pool.pool and b.ref_cnt == 1
        ]

    # -- rules --------------------------------------------------------------
    # Rules that need something to act on say so in a precondition, so every
    # drawn step is valid: an assume() inside a rule would discard the whole
    # example, and the health check rejects runs that discard too many.

    @rule(data=st.data(), nt=st.integers(0, 12), ns=st.integers(0, 6))
    def allocate(self, data, nt, ns):
        arena = self.arena
        tok, st_ = self.pools()
        floors = oracle_floors(arena, nt, ns)
        before = snapshot(arena)
        assert can_allocate(arena.boundary, nt, ns) == bool(floors)
        assert snapshot(arena) == before
        floor = arena.state_floor
        layout = arena.layout
        # entries each feasible floor's move would evict
        expect_removed = {
            f: map_entries(
                tok, [t for t in tok.owned_ids if t not in layout.token_ids_at(f)]
            )
            + map_entries(
                st_, [s for s in st_.owned_ids if s not in layout.state_ids_at(f)]
            )
            for f in floors
        }
        self.drain_events()

        ok = ensure(arena.boundary, nt, ns)
        assert ok == bool(floors)
        if not ok:
            assert snapshot(arena) == before
            return
        if floor in floors:
            # no move needed; a recency move may still trade the staler
            # pool's blocks for the other's entries
            assert arena.state_floor in floors
        else:
            # the smallest move that works
            assert arena.state_floor == min(floors, key=lambda f: abs(f - floor))
        removed = [
            e
            for p in self.pools()
            for e in p.take_events()
            if isinstance(e, BlockRemoved)
        ]
        expected = expect_removed[arena.state_floor]
        assert len(removed) == (expected if self.events else 0)
        req = self.pick_request(data, data.draw(st.booleans(), label="new"))
        for pool, n in ((tok, nt), (st_, ns)):
            expected = pool.free_block_queue.get_all_free_blocks()[:n]
            got = pool.get_new_blocks(n)
            assert got == expected
            assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
            self.requests[req].extend(got)

    @rule(data=st.data(), nt=st.integers(0, 12), ns=st.integers(0, 6))
    def allocate_sparing_protected(self, data, nt, ns):
        """What the pooled coordinator tries first: serve a request without
        handing out or giving away any protected cache entry."""
        arena = self.arena
        floors = oracle_floors(arena, nt, ns, spare_protected=True)
        protected = [
            pool.blocks[i]
            for pool in self.pools()
            for i in protected_ids(pool.free_block_queue)
        ]
        before = snapshot(arena)
        ok = ensure(arena.boundary, nt, ns, reach=Reach.SPARE_PROTECTED)
        assert ok == bool(floors)
        if not ok:
            assert snapshot(arena) == before
            return
        req = self.pick_request(data, True)
        for pool, n in zip(self.pools(), (nt, ns), strict=True):
            self.requests[req].extend(pool.get_new_blocks(n))
        for block in protected:
            assert block.ref_cnt == 0 and block.block_hash is not None
            assert block.pool.free_block_queue.is_protected(block)

    @rule(data=st.data(), side=st.sampled_from(PoolKind), n=st.integers(1, 12))
    def get_new_blocks_directly(self, data, side, n):
        arena = self.arena
        pool = arena.pool(side)
        need = (n, 0) if side is PoolKind.TOKEN else (0, n)
        feasible = bool(oracle_floors(arena, *need))
        before = snapshot(arena)
        assert ensure(arena.boundary, *need) == feasible
        if not feasible:
            assert snapshot(arena) == before
            with pytest.raises(ValueError, match=f"Cannot get {n} free blocks"):
                pool.get_new_blocks(n)  # a pool never moves the boundary
            assert snapshot(arena) == before
            return
        got = pool.get_new_blocks(n)
        assert len(got) == n and all(b.block_id in pool.owned_ids for b in got)
        self.requests[self.pick_request(data, True)].extend(got)

    @precondition(lambda self: any(self.requests.values()))
    @rule(data=st.data())
    def free_some(self, data):
        req = data.draw(st.sampled_from([r for r, b in self.requests.items() if b]))
        held = self.requests[req]
        order = data.draw(st.permutations(range(len(held))), label="order")
        count = data.draw(st.integers(1, len(held)), label="count")
        chosen = [held[i] for i in order[:count]]
        self.requests[req] = [b for i, b in enumerate(held) if i not in order[:count]]
        self.pools()[0].free_blocks(chosen)  # routes state blocks by block.pool

    @precondition(lambda self: any(self.requests.values()))
    @rule(data=st.data(), reuse=st.booleans())
    def cache_held(self, data, reuse):
        blocks = [b for bs in self.requests.values() for b in bs]
        block = data.draw(st.sampled_from(blocks), label="block")
        pool = block.pool
        existing = list(pool.cached_block_hash_to_block._cache)
        if reuse and existing:
            hash_key = data.draw(st.sampled_from(existing), label="key")
        else:
            self.next_hash += 1
            hash_key = key(pool, self.next_hash.to_bytes(8, "big"))
        pool._insert_block_hash(hash_key, block, num_tokens=16)

    @precondition(lambda self: bool(self.cached_keys()))
    @rule(data=st.data())
    def prefix_hit(self, data):
        candidates = self.cached_keys()
        pool, hash_key = data.draw(st.sampled_from(candidates), label="hit")
        hit = pool.get_cached_block(get_block_hash(hash_key), [get_group_id(hash_key)])
        assert hit is not None
        free_before = pool.get_num_free_blocks()
        was_free = hit[0].ref_cnt == 0
        pool.touch(hit)
        assert pool.get_num_free_blocks() == free_before - was_free
        self.requests[self.pick_request(data, True)].extend(hit)

    @precondition(lambda self: bool(self.cached_keys()))
    @rule(data=st.data())
    def shared_entry_served_and_released(self, data):
        """Two requests hit one entry and finish: the entry has served
        PROTECT_AFTER_HITS hits and rests in its pool's protected segment."""
        pool, hash_key = data.draw(st.sampled_from(self.cached_keys()), label="hit")
        hit = pool.get_cached_block(get_block_hash(hash_key), [get_group_id(hash_key)])
        assert hit is not None
        for _ in range(PROTECT_AFTER_HITS):
            pool.touch(hit)
        pool.free_blocks(hit * PROTECT_AFTER_HITS)
        (block,) = hit
        assert pool.free_block_queue.policy.is_proven(block)
        if block.ref_cnt == 0:
            assert pool.free_block_queue.is_protected(block)
            # the most recently freed of its segment; the state pool hands
            # out its last ``window`` entries farthest from the boundary first
            queue = pool.free_block_queue
            last = queue.get_all_free_blocks()[-max(1, queue.window) :]
            assert any(b is block for b in last)

    @rule(side=st.sampled_from(PoolKind), data=st.data())
    def evict_by_id(self, side, data):
        pool = self.arena.pool(side)
        chosen = data.draw(
            st.sets(st.integers(0, len(pool.blocks) - 1), max_size=4), label="ids"
        )
        free_before = pool.get_num_free_blocks()
        pool.evict_blocks(chosen)
        assert pool.get_num_free_blocks() == free_before
        for i in chosen:
            assert pool.blocks[i].block_hash is None

    @precondition(lambda self: bool(self.held_single_state_blocks()))
    @rule(data=st.data())
    def advance_state_in_place(self, data):
        """A held state block lent back to its holder (the pooled
        coordinator's in-place crossing): a second reference, out of the
        prefix cache, no free block consumed."""
        held = self.held_single_state_blocks()
        req, block = data.draw(st.sampled_from(held), label="lent")
        pool = self.arena.state_pool
        free_before = pool.get_num_free_blocks()
        got = InPlaceView(pool, block).get_new_blocks(1)
        assert got == [block] and block.ref_cnt == 2 and block.block_hash is None
        assert pool.get_num_free_blocks() == free_before
        self.requests[req].append(block)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def preempt(self, data):
        req = data.draw(st.sampled_from(sorted(self.requests)), label="victim")
        blocks = self.requests.pop(req)
        self.pools()[0].free_blocks(reversed(blocks))

    @rule(whole=st.booleans(), side=st.sampled_from(PoolKind))
    def reset_prefix_cache(self, whole, side):
        pools = self.pools() if whole else (self.arena.pool(side),)
        all_free = all(p.get_num_free_blocks() == p.owned_capacity for p in pools)
        if whole:
            assert self.arena.reset_prefix_cache() == all_free
        else:
            assert pools[0].reset_prefix_cache() == all_free
        if all_free:
            for pool in pools:
                assert len(pool.cached_block_hash_to_block) == 0
                assert cached_ids(pool.free_block_queue) == []
                assert all(b.block_hash is None for b in pool.blocks)

    # -- invariants ---------------------------------------------------------

    @rule(clearing=st.booleans())
    def clear_boundary(self, clearing):
        assert self.arena is not None
        self.arena.token_pool.clear_boundary(clearing)

    @invariant()
    def bookkeeping_is_consistent(self):
        if self.arena is None:
            return
        check_invariants(self.arena)
        held = Counter(
            (b.pool.side, b.block_id) for bs in self.requests.values() for b in bs
        )
        for pool in self.pools():
            for block in pool.blocks[1:]:
                assert block.ref_cnt == held[(pool.side, block.block_id)]

    def teardown(self):
        if self.arena is None:
            return
        for blocks in self.requests.values():
            self.pools()[0].free_blocks(reversed(blocks))
        self.requests.clear()
        check_invariants(self.arena)
        for pool in self.pools():
            assert pool.get_num_free_blocks() == pool.owned_capacity


# Examples, seeds and health checks come from the profile (tests/conftest.py).
ArenaMachine.TestCase.settings = settings(stateful_step_count=30)
TestArenaMachine = ArenaMachine.TestCase


def test_token_pool_events_include_the_state_pools():
    """KVCacheManager reads events from its block_pool (the token pool) only."""
    arena = make_arena(events=True)
    st_ = arena.state_pool
    held = st_.get_new_blocks(5)
    cache(st_, held[4], b"s5")
    st_.free_blocks(held)
    assert ensure(arena.boundary, 10, 0)  # evicts the cached state block in the way
    events = arena.token_pool.take_events()
    assert [type(e) for e in events] == [BlockRemoved]
    assert events[0].group_idx == 1
    assert st_.take_events() == [] and arena.token_pool.take_events() == []


def test_a_move_never_takes_a_prefix_hit_about_to_be_reused():
    """The coordinator passes hit blocks (free, cached, not yet touched)."""
    arena = make_arena(events=True)
    st_ = arena.state_pool
    held = st_.get_new_blocks(5)
    cache(st_, held[4], b"s5")  # id 5, at the boundary
    st_.free_blocks(held)
    hit = st_.blocks[5]
    before = snapshot(arena)
    assert not can_allocate(arena.boundary, 10, 0, keep=[hit])
    assert not ensure(arena.boundary, 10, 0, keep=[hit])
    assert snapshot(arena) == before
    assert st_.get_cached_block(BlockHash(b"s5"), [1]) == [hit]
    assert ensure(arena.boundary, 10, 0)  # without the hit, the move evicts it
    check_invariants(arena)
