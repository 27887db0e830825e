"""Evicted entries asked for again (``policy.ghosts``, ``pooled.misses``) and
the split that follows them (``ArenaSplit.MISSES``).

A pool keeps the keys of the entries it evicted for room; a lookup that
finds one past its hit counts the tokens that eviction cost it. The arena's
boundary then favours the pool whose evictions cost more per byte.
"""

from __future__ import annotations

import pytest
from test_arena import SMALL, cache
from test_arena_split import _cache_free, _cached
from test_eviction import BLOCK, SHARED, Driver, _one_off
from vllm.v1.core import kv_cache_manager

from vllm_hybrid import envs
from vllm_hybrid.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.policy import (
    GHOST_MAX_KEYS,
    GHOST_MIN_EVICTIONS,
    GHOST_REGRET_MARGIN,
    ArenaSplit,
    Entry,
    Ghosts,
    regret_favours,
)


@pytest.fixture
def driver(monkeypatch) -> Driver:
    monkeypatch.setattr(
        kv_cache_manager, "get_kv_cache_coordinator", get_kv_cache_coordinator
    )
    return Driver()


def _ghosts(evicted: int, lost: int, limit: int = 1000) -> Ghosts:
    ghosts = Ghosts(limit)
    for i in range(evicted):
        ghosts.note_evicted(i)
    if lost:
        ghosts.lost(lost)
    return ghosts


def test_a_pool_remembers_its_latest_evictions_up_to_its_size():
    ghosts = Ghosts(3)
    for key in "abcd":
        ghosts.note_evicted(key)
    assert list(ghosts.keys) == ["b", "c", "d"] and ghosts.evicted == 4
    assert not ghosts.forget("a")  # the oldest was forgotten
    assert ghosts.forget("c") and not ghosts.forget("c")
    ghosts.lost(48)
    assert (ghosts.asked, ghosts.lost_tokens) == (1, 48)


def test_regret_is_the_tokens_lost_per_recent_eviction():
    assert _ghosts(GHOST_MIN_EVICTIONS - 1, 100).regret() is None
    ghosts = _ghosts(100, 250, limit=10**9)
    assert ghosts.regret() == pytest.approx(2.5, rel=1e-2)
    # a pool of 10 ghosts is measured after 5 (its decayed count stays <= 10)
    assert _ghosts(4, 8, limit=10).regret() is None
    # 40 evictions decayed by 0.9 each count (1 - 0.9**40) / 0.1 = 9.85
    assert _ghosts(40, 80, limit=10).regret() == pytest.approx(80 / 9.852, rel=1e-3)
    assert Ghosts(10**9).limit == GHOST_MAX_KEYS
    # older evictions and losses fade over about one pool's worth
    faded = _ghosts(100, 250, limit=50)
    for i in range(200):
        faded.note_evicted(("later", i))
    assert faded.recent_lost < 250 * 0.02


def test_the_split_favours_the_pool_whose_evictions_cost_more_per_byte():
    # 10 tokens lost per eviction of a 100 B block against 1 per 4 B block:
    # 0.1 against 0.25 tokens per byte, the second pool's memory is worth more
    state, token = _ghosts(100, 1000), _ghosts(100, 100)
    assert regret_favours(state, token, 100, 4) is False
    assert regret_favours(token, state, 4, 100) is True
    # within the margin neither wins; the recency comparison decides
    near = _ghosts(100, round(100 * 100 / 4 * GHOST_REGRET_MARGIN * 0.9))
    assert regret_favours(near, token, 100, 4) is None
    assert regret_favours(_ghosts(5, 500), token, 100, 4) is None


def test_an_entry_evicted_for_room_leaves_a_ghost_a_useless_one_does_not():
    arena = KVArena(SMALL, enable_caching=True, hash_block_size=16)
    # the default split keeps no ghosts; a benchmark (or the misses split)
    # has the pools keep them
    assert not arena.follows_misses and arena.state_pool.ghosts is None
    arena.follow_misses()
    assert arena.follows_misses
    state = arena.state_pool
    blocks = state.get_new_blocks(5)
    for i, block in enumerate(blocks):
        cache(state, block, b"state" + bytes([i]))
    state.free_blocks(blocks)
    keys = {b.block_id: b.block_hash for b in blocks}
    # a superseded checkpoint is evicted as useless: no bet, no ghost
    state.rank_entry(blocks[0], Entry.SUPERSEDED)
    assert blocks[0].block_hash is None and state.ghosts.evicted == 0
    (taken,) = state.get_new_blocks(1)  # the clean one first
    assert taken is blocks[0] and state.ghosts.evicted == 0
    (taken,) = state.get_new_blocks(1)  # then a cached entry, for room
    assert state.ghosts.evicted == 1
    assert list(state.ghosts.keys) == [keys[taken.block_id]]


@pytest.mark.parametrize("follow", [True, False])
def test_a_lookup_past_an_evicted_prefix_counts_what_it_lost(driver, follow):
    """The shared prompt's blocks are the oldest; one-off prompts evict its
    last attention block for room, which kills the rest of its entries (no
    ghost for those). The probe hits nothing and finds that ghost at its
    fourth block: 64 tokens lost to the token pool's eviction. Lookups look
    only where the arena follows its misses (the misses split, or a
    benchmark that asked)."""
    arena = driver.arena
    assert not arena.follows_misses  # the default split does not
    if follow:
        arena.follow_misses()
    token, state = arena.token_pool.ghosts, arena.state_pool.ghosts
    assert driver.serve(driver.request("shared", [*SHARED, 100])) == 0
    for i in range(6):
        driver.serve(driver.request(f"once{i}", _one_off(4 * BLOCK + 1, i)))
    if follow:
        assert token.evicted > 0 and (token.asked, state.asked) == (0, 0)
    assert driver.hits_shared() == 0
    if not follow:
        # nothing kept, nothing looked for
        assert (token, state) == (None, None) and not arena.follows_misses
        return
    assert (token.asked, token.lost_tokens) == (1, 4 * BLOCK)
    assert state.asked == 0
    # asked once: the probe computed and cached the prefix again
    assert driver.hits_shared() == len(SHARED)
    assert token.asked == 1


@pytest.mark.parametrize("split", [ArenaSplit.COSTED, ArenaSplit.MISSES])
def test_the_boundary_follows_the_pool_whose_evictions_are_asked_for_again(
    monkeypatch, split
):
    """``test_costed_eviction``'s arena: by recency the token pool takes the
    state block next to the boundary (id 5), whose entry saves no more than
    attention KV. When the state pool's evictions lately lost more tokens
    per byte than the token pool's, ``MISSES`` keeps the state block and the
    token pool evicts its own least recently used entry instead."""
    monkeypatch.setenv(envs.ARENA_SPLIT_VAR, split.value)
    arena = KVArena(SMALL, enable_caching=True, hash_block_size=16, break_even=40)
    state = arena.state_pool
    blocks = state.get_new_blocks(5)
    for i, block in enumerate(blocks):
        cache(state, block, b"state" + bytes([i]))
    state.free_blocks(blocks)
    _cache_free(arena.token_pool, 9, b"token")
    # the misses split keeps ghosts from the start; the costed one as a
    # benchmark would have it (its decisions do not read them)
    assert arena.follows_misses == (split is ArenaSplit.MISSES)
    arena.follow_misses()
    # 100 evictions each: the state pool's lost 30 tokens per 10 B block,
    # the token pool's 1 per 4 B block (3 against 0.25 tokens per byte)
    for i in range(100):
        state.ghosts.note_evicted(("s", i))
        arena.token_pool.ghosts.note_evicted(("t", i))
    state.ghosts.lost(3000)
    arena.token_pool.ghosts.lost(100)
    assert arena.boundary.ensure(1, 0)
    arena.token_pool.get_new_blocks(1)
    if split is ArenaSplit.MISSES:
        assert arena.state_floor == 5 and _cached(state) == 5
        assert _cached(arena.token_pool) == 8
    else:
        assert arena.state_floor == 6 and _cached(state) == 4
        assert _cached(arena.token_pool) == 9
    arena.check_invariants()
