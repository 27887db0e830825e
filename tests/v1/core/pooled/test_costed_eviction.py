"""Entries weighed by the recomputation they save per byte.

An attention block saves the recomputation of its own tokens; a state entry
saves the tokens between the previous checkpoint its request kept (or the
prefix hit it started from) and its own position. Where the arena's two pools
compete for bytes, the one whose entry saves less per byte gives them up;
among the state pool's oldest entries, those worth less than attention KV go
first.

The arena is ``test_arena.SMALL`` (4 B token blocks of 16 tokens, 10 B state
blocks): one state block's bytes hold 40 tokens of attention KV, the
break-even it is given. Token ids 3..11 and state ids 5..9 at the start; one more token
block's room takes state id 5 (token ids 12..14 arrive).
"""

from __future__ import annotations

import random

import pytest
from pooled_invariants import cached_ids, check_invariants, ensure
from test_arena import SMALL, cache
from test_arena_split import _cache_free, _cached
from test_eviction import BLOCK, Driver, use_pooled_manager

from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.policy.eviction import Entry, worth_more_than_attention
from vllm_hybrid.v1.core.pooled.policy.positions import state_block_attention_tokens


def _arena(weighed: bool = True) -> KVArena:
    """The arena, its state entries weighed against attention KV or (to
    compare) by recency alone."""
    return KVArena(
        SMALL,
        enable_caching=True,
        hash_block_size=16,
        break_even=40 if weighed else None,
    )


def test_the_break_even_is_the_attention_tokens_a_state_block_holds(monkeypatch):
    """``test_eviction``'s plan: 8,192 B state blocks and token blocks of 16
    tokens in 8,192 B, so a state block's bytes hold 16 tokens of attention
    KV; the coordinator hands that to its arena."""
    use_pooled_manager(monkeypatch)
    driver = Driver()
    assert state_block_attention_tokens(driver.coordinator.kv_cache_config) == 16
    assert driver.arena.state_pool.free_block_queue.policy.break_even == 16
    assert not worth_more_than_attention(40, 40)
    assert worth_more_than_attention(41, 40)
    assert not worth_more_than_attention(None, 40)
    assert not worth_more_than_attention(10**6, None)


@pytest.mark.parametrize("weighed", [True, False])
@pytest.mark.parametrize("saves", [40, 41])
def test_an_entry_that_saves_more_per_byte_outlives_one_that_saves_less(weighed, saves):
    """The state pool's entries are older than all of the token pool's, so by
    recency alone the token pool takes the state block next to the boundary
    (id 5) and its entry. Weighed, an entry that saves more than 40 tokens
    is worth more per byte than the token pool's own least recently used
    entry, which goes instead."""
    arena = _arena(weighed)
    state = arena.state_pool
    blocks = state.get_new_blocks(5)
    for i, block in enumerate(blocks):
        cache(state, block, b"state" + bytes([i]))
    state.free_blocks(blocks)
    (boundary_block,) = [b for b in blocks if b.block_id == 5]
    state.rank_entry(boundary_block, Entry.PREFILL_ANCHOR, saves)
    assert state.free_block_queue.policy.saves_of(boundary_block) == saves
    _cache_free(arena.token_pool, 9, b"token")
    assert ensure(arena.boundary, 1, 0)
    arena.token_pool.get_new_blocks(1)
    if weighed and saves > 40:
        assert arena.state_floor == 5 and _cached(state) == 5
        assert boundary_block.block_hash is not None
        assert _cached(arena.token_pool) == 8  # its LRU entry went
    else:
        assert arena.state_floor == 6 and _cached(state) == 4
        assert boundary_block.block_hash is None
        assert _cached(arena.token_pool) == 9
    check_invariants(arena)


@pytest.mark.parametrize("weighed", [True, False])
def test_among_the_oldest_states_those_worth_less_than_attention_go_first(weighed):
    """Five state entries, oldest first at ids 9, 8, 7, 6, 5 (all within the
    state pool's window); 9 and 8 save 41 tokens, the others 40. Weighed, 7
    goes first (the farthest from the boundary of those worth no more than
    attention KV); unweighed, 9 (the farthest of all)."""
    state = _arena(weighed).state_pool
    blocks = state.get_new_blocks(5)
    assert [b.block_id for b in blocks] == [9, 8, 7, 6, 5]
    for i, block in enumerate(blocks):
        cache(state, block, b"state" + bytes([i]))
    state.free_blocks(blocks)
    for block in blocks:
        state.rank_entry(block, Entry.PREFILL_ANCHOR, 41 if block.block_id > 7 else 40)
    assert cached_ids(state.free_block_queue)[0] == (7 if weighed else 9)
    (taken,) = state.get_new_blocks(1)
    assert taken.block_id == (7 if weighed else 9)


def test_a_checkpoint_saves_the_tokens_past_the_previous_one(monkeypatch):
    """A 100-token prompt in chunks ending at 32, 64 and 96 keeps states
    there (prefill checkpoints every 32 tokens): each saves 32 tokens. A
    150-token prompt that shares the first 70 tokens hits the state at 64
    and computes to 144 in one chunk: its prompt's own checkpoint saves
    the 80 tokens past its hit."""
    use_pooled_manager(monkeypatch)
    driver = Driver(arena_blocks=40, max_num_seqs=2, prefill_interval=2 * BLOCK)
    rng = random.Random(3)
    tokens = [rng.randrange(200, 900) for _ in range(100)]
    states = driver.coordinator.single_type_managers[1].req_to_blocks
    policy = driver.arena.state_pool.free_block_queue.policy

    def run(request, chunks):
        at = {}
        for chunk in chunks:
            assert driver.step(request, chunk)
            end = request.num_computed_tokens
            at[end] = states[request.request_id][(end - 1) // BLOCK]
        driver.manager.free(request)
        return {end: policy.saves_of(block) for end, block in at.items()}

    first = driver.request("first", tokens)
    assert run(first, (32, 32, 32, 4)) == {32: 32, 64: 32, 96: 32, 100: None}
    second = driver.request("second", tokens[:70] + [7] * 80)
    assert driver.admit(second) == 64 and second.num_computed_tokens == 144
    own = states["second"][144 // BLOCK - 1]
    assert run(second, (6,)) == {150: None}
    assert policy.saves_of(own) == 144 - 64  # from its hit, not from 0
    check_invariants(driver.arena)
