"""The token pool's clean blocks next to the arena's boundary, handed out
after its cached ones while the arena refuses requests
(``eviction.CLEARING_ORDER``).

The arena is ``test_arena.SMALL``: token ids 3..11 and state ids 5..9 at the
start; one more token block's room takes state id 5 and brings token ids
12..14.
"""

from __future__ import annotations

import random

import pytest
from pooled_invariants import (
    cached_ids,
    check_invariants,
    clean_at_boundary_ids,
    ensure,
)
from test_arena import cache, make_arena
from test_eviction import Driver, use_pooled_manager

from vllm_hybrid.v1.core.pooled import arena as arena_module
from vllm_hybrid.v1.core.pooled.policy.eviction import BOUNDARY_CLEAR_STATE_BLOCKS


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


@pytest.mark.parametrize("clearing", [False, True])
def test_while_clearing_cached_entries_go_before_clean_blocks_at_the_boundary(
    clearing,
):
    """Ids 9..11 are the three next to the boundary; 3 and 4 hold entries,
    the rest is clean. Clearing, the pool evicts both entries before it
    hands out a clean block next to the boundary; else it keeps them."""
    token = make_arena().token_pool
    token.keep_boundary_clear(3)
    held = token.get_new_blocks(9)
    for block in held[:2]:
        cache(token, block, bytes([block.block_id]))
    token.free_blocks(held)
    queue = token.free_block_queue
    assert clean_at_boundary_ids(queue) == [9, 10, 11]
    token.clear_boundary(clearing)
    taken = token.get_new_blocks(7)
    if clearing:
        assert _ids(taken) == [5, 6, 7, 8, 3, 4, 9]
        assert cached_ids(queue) == []
    else:
        assert _ids(taken) == [5, 6, 7, 8, 9, 10, 11]
        assert cached_ids(queue) == [3, 4]


def test_the_blocks_next_to_the_boundary_follow_its_moves():
    arena = make_arena()
    token = arena.token_pool
    token.keep_boundary_clear(3)
    queue = token.free_block_queue
    assert clean_at_boundary_ids(queue) == [9, 10, 11]
    state = arena.state_pool
    state.get_new_blocks(4)  # ids 9..6 live: the token pool can take id 5
    assert ensure(arena.boundary, 10, 0)
    assert token.owned_ids == range(3, 15)
    assert clean_at_boundary_ids(queue) == [12, 13, 14]
    token.get_new_blocks(12)
    assert clean_at_boundary_ids(queue) == []
    check_invariants(arena)


def test_the_arena_keeps_clear_state_blocks_worth_of_token_ids(monkeypatch):
    """16 state blocks of 10 B hold 40 token blocks of 4 B: more than the
    token pool's nine, so all of them; with the variable at 1, two."""
    assert BOUNDARY_CLEAR_STATE_BLOCKS == 16
    assert clean_at_boundary_ids(make_arena().token_pool.free_block_queue) == list(
        range(3, 12)
    )
    monkeypatch.setattr(arena_module, "BOUNDARY_CLEAR_STATE_BLOCKS", 1)
    queue = make_arena().token_pool.free_block_queue
    assert clean_at_boundary_ids(queue) == [10, 11]
    assert clean_at_boundary_ids(make_arena().state_pool.free_block_queue) == []


def test_the_coordinator_clears_while_the_arena_refuses_new_requests(monkeypatch):
    """A 16-block arena serves one 150-token prompt; a second is refused
    while the first runs (the token pool clears its boundary) and served
    once it is freed (it stops)."""
    use_pooled_manager(monkeypatch)
    driver = Driver(arena_blocks=16, max_num_seqs=1)
    rng = random.Random(7)
    queue = driver.arena.token_pool.free_block_queue
    first = driver.request("first", [rng.randrange(200, 900) for _ in range(150)])
    assert driver.admit(first) == 0 and not queue.clearing
    second = driver.request("second", [rng.randrange(200, 900) for _ in range(150)])
    assert driver.admit(second) is None
    assert queue.clearing
    driver.manager.free(first)
    assert driver.admit(second) == 0
    assert not queue.clearing
