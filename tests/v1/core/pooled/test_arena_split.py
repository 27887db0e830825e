"""When the arena's boundary moves by recency.

A pool whose need would evict a cached entry filed in LRU order takes the
other pool's free blocks next to the boundary instead, when the other pool's
own next LRU victim is older. The arena here is ``test_arena.SMALL``: token
ids 3..11 and state ids 5..9 at the start; one more state block takes token
ids 10 and 11, one more token block's room takes state id 5 (token ids
12..14 arrive).
"""

from __future__ import annotations

import pytest
from pooled_invariants import cached_ids, check_invariants, clean_ids, ensure
from test_arena import cache, make_arena

from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.policy.eviction import SPLIT_TOKEN_RESERVE


def _cache_free(pool, n: int, prefix: bytes) -> list:
    """Take ``n`` blocks of ``pool``, cache each, free them (in that order)."""
    blocks = pool.get_new_blocks(n)
    for i, block in enumerate(blocks):
        cache(pool, block, prefix + bytes([i]))
    pool.free_blocks(blocks)
    return blocks


def _cached(pool) -> int:
    return len(cached_ids(pool.free_block_queue))


def _state_pool_full_of_entries(arena: KVArena) -> None:
    _cache_free(arena.state_pool, 5, b"state")
    assert clean_ids(arena.state_pool.free_block_queue) == []


def test_the_state_pool_grows_into_clean_token_blocks_instead_of_evicting():
    arena = make_arena()
    _state_pool_full_of_entries(arena)
    assert ensure(arena.boundary, 0, 1)
    (block,) = arena.state_pool.get_new_blocks(1)
    assert arena.state_floor == 4 and arena.token_capacity == 7
    assert block.block_id == 4 and _cached(arena.state_pool) == 5
    check_invariants(arena)


@pytest.mark.parametrize("filed_first", [True, False])
def test_the_state_pool_grows_only_into_token_entries_older_than_its_own(
    filed_first,
):
    """Token ids 10 and 11 hold entries filed before (or after) the state
    pool's; an older token entry at id 3 makes the token pool the staler one
    either way."""
    arena = make_arena()
    token = arena.token_pool
    held = token.get_new_blocks(9)
    cache(token, held[0], b"oldest")
    token.free_blocks([held[0]])
    if filed_first:
        for block, name in zip(held[7:], (b"a", b"b"), strict=True):
            cache(token, block, name)
        token.free_blocks(held[7:])
    _state_pool_full_of_entries(arena)
    if not filed_first:
        for block, name in zip(held[7:], (b"a", b"b"), strict=True):
            cache(token, block, name)
        token.free_blocks(held[7:])
    token.free_blocks(held[1:7])
    assert [b.block_id for b in held[7:]] == [10, 11]
    assert ensure(arena.boundary, 0, 1)
    assert arena.state_floor == (4 if filed_first else 5)
    assert _cached(token) == (1 if filed_first else 3)
    arena.state_pool.get_new_blocks(1)
    # grown, the state pool hands out the clean id 4; else its LRU entry goes
    assert _cached(arena.state_pool) == (5 if filed_first else 4)
    check_invariants(arena)


@pytest.mark.parametrize("live", [2, 3])
def test_the_state_pool_leaves_the_token_pool_its_reserve(live):
    """The token pool keeps ``SPLIT_TOKEN_RESERVE`` of its 9 blocks (5) free
    beyond the need: with 2 held, 7 free less the 2 given up leave 5."""
    assert SPLIT_TOKEN_RESERVE == 0.5
    arena = make_arena()
    arena.token_pool.get_new_blocks(live)
    _state_pool_full_of_entries(arena)
    assert ensure(arena.boundary, 0, 1)
    assert arena.state_floor == (4 if live == 2 else 5)
    check_invariants(arena)


@pytest.mark.parametrize("state_older", [True, False])
def test_the_token_pool_takes_state_blocks_when_the_state_pool_is_staler(
    state_older,
):
    arena = make_arena()
    if state_older:
        _state_pool_full_of_entries(arena)
    _cache_free(arena.token_pool, 9, b"token")
    if not state_older:
        _state_pool_full_of_entries(arena)
    assert ensure(arena.boundary, 1, 0)
    arena.token_pool.get_new_blocks(1)
    if state_older:
        # state id 5 went (its entry with it); token ids 12..14 arrived
        assert arena.state_floor == 6 and arena.token_capacity == 12
        assert _cached(arena.token_pool) == 9 and _cached(arena.state_pool) == 4
    else:
        assert arena.state_floor == 5
        assert _cached(arena.token_pool) == 8 and _cached(arena.state_pool) == 5
    check_invariants(arena)
