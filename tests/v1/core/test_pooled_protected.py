"""Cache entries that served several prefix hits are evicted last.

Each arena pool's free queue keeps cached blocks with
``PROTECT_AFTER_HITS`` hits in a second LRU segment, handed out only after
every clean and every other cached block (a segmented LRU). The pooled
coordinator serves a request without touching that segment when it can, and
otherwise lets a running request cross its state block edge in place (losing
a checkpoint that has served no hit yet) before it evicts a protected entry.
The hypothesis machine in ``test_arena.py`` checks the arena side.
"""

from __future__ import annotations

from types import SimpleNamespace

from test_arena import cache, free_order, make_arena

from vllm_hybrid.v1.core.pooled.block_pool import PROTECT_AFTER_HITS
from vllm_hybrid.v1.core.pooled.coordinator import PooledHybridKVCacheCoordinator
from vllm_hybrid.v1.core.pooled.spec import PoolKind


def test_entries_hit_twice_are_handed_out_last():
    arena = make_arena()
    pool = arena.token_pool
    blocks = pool.get_new_blocks(3)  # ids 3, 4, 5
    for block, name in zip(blocks, (b"once", b"twice", b"never"), strict=True):
        cache(pool, block, name)
    pool.free_blocks(blocks)
    pool.touch([blocks[0]])
    pool.touch([blocks[1]])
    pool.touch([blocks[1]])
    pool.free_blocks([blocks[0], blocks[1], blocks[1]])
    queue = pool.free_block_queue
    assert PROTECT_AFTER_HITS == 2
    assert queue.protected_ids() == [4]
    # clean blocks, then the LRU of ordinary entries, then protected ones
    assert free_order(pool)[-3:] == [5, 3, 4]
    assert pool.hit_counts() == {3: 1, 4: 2}
    arena.check_invariants()
    # reused (evicted) it starts over
    pool.evict_blocks({4})
    assert queue.protected_ids() == [] and pool.hit_counts() == {3: 1}
    arena.check_invariants()


def test_serving_without_protected_entries_spares_them():
    arena = make_arena()
    pool = arena.state_pool
    (block,) = pool.get_new_blocks(1)
    cache(pool, block, b"shared")
    pool.free_blocks([block])
    for _ in range(PROTECT_AFTER_HITS):
        pool.touch([block])
    pool.free_blocks([block] * PROTECT_AFTER_HITS)
    free, floor = pool.get_num_free_blocks(), arena.state_floor
    # the state pool alone could serve `free` blocks only with the protected
    # one; sparing it, the arena grows the state pool by one block instead
    assert arena.ensure(0, free, spare_protected=True)
    assert arena.state_floor == floor - 1
    got = pool.get_new_blocks(free)
    assert block not in got
    assert pool.free_block_queue.is_protected(block) and block.block_hash is not None
    arena.check_invariants()
    # with nothing left to spare it, it goes like any cached block
    pool.free_blocks(got)
    everything = pool.get_num_free_blocks() + arena.token_pool.get_num_free_blocks()
    assert not arena.ensure(0, everything, spare_protected=True)


class _Arena:
    """What the coordinator asks of the arena, scripted."""

    def __init__(self, spared_ok: bool, any_ok: bool) -> None:
        self.spared_ok, self.any_ok = spared_ok, any_ok
        self.calls: list[tuple] = []
        self.state_pool = SimpleNamespace(num_gpu_blocks=100)

    def ensure(self, need_token, need_state, keep=(), spare_protected=False):
        self.calls.append((need_token, need_state, spare_protected))
        return self.spared_ok if spare_protected else self.any_ok


def _coordinator(arena: _Arena, in_place: bool):
    coord = object.__new__(PooledHybridKVCacheCoordinator)
    manager = SimpleNamespace(get_num_blocks_to_allocate=lambda *a, **k: 1)
    coord.single_type_managers = (manager, manager)
    coord._group_kind = (PoolKind.TOKEN, PoolKind.STATE)
    coord.retention_interval = 0
    coord.arena = arena
    coord.block_pool = SimpleNamespace(get_num_free_blocks=lambda: 7)
    coord._in_place = {}
    coord.short_memory_counts = {"state_in_place": 0}
    coord._in_place_blocks = lambda request_id, needs: (
        {1: "running"} if in_place else {}
    )
    return coord


def _allocate(coord) -> int:
    return coord.get_num_blocks_to_allocate("r", 16, ((), ()), 0, 0, 0, 16)


def test_a_running_request_crosses_in_place_before_a_protected_entry_goes():
    arena = _Arena(spared_ok=False, any_ok=True)
    coord = _coordinator(arena, in_place=True)
    assert _allocate(coord) == 1
    assert arena.calls == [(1, 1, True), (1, 0, False)]
    assert coord._in_place == {"r": {1: "running"}}
    assert coord.short_memory_counts["state_in_place"] == 1


def test_without_an_in_place_crossing_a_protected_entry_is_evicted():
    arena = _Arena(spared_ok=False, any_ok=True)
    coord = _coordinator(arena, in_place=False)
    assert _allocate(coord) == 1
    assert arena.calls == [(1, 1, True), (1, 1, False)]
    assert coord._in_place == {}


def test_served_without_protected_entries_no_crossing_in_place():
    arena = _Arena(spared_ok=True, any_ok=True)
    coord = _coordinator(arena, in_place=True)
    assert _allocate(coord) == 1
    assert arena.calls == [(1, 1, True)]
    assert coord._in_place == {}


def test_nothing_serves_refuses():
    arena = _Arena(spared_ok=False, any_ok=False)
    coord = _coordinator(arena, in_place=False)
    assert _allocate(coord) == 8  # upstream's "cannot allocate": free + 1
