"""One allocation path: counting changes nothing, the allocation carries out
what admission decided.

Upstream's scheduler may count a request's blocks
(``get_num_blocks_to_allocate``) without allocating them. In pooled mode an
allocation may move the arena's boundary (for the request's blocks and the
growth reserve), move live token blocks off it, or advance a running state
in place; a count decides the same but carries out none of it. The arenas
are ``test_eviction``'s plans.
"""

from __future__ import annotations

from pooled_invariants import check_invariants
from test_arena import snapshot
from test_eviction import BLOCK, Driver, _one_off, use_pooled_manager


def _everything(driver: Driver):
    """What an allocation could change: both pools (free order, references,
    hashes), the boundary, the pending token moves, the coordinator's
    counters, the arena's refusal mode and every request's block table."""
    coordinator = driver.coordinator
    moves = driver.arena.boundary.moves
    return (
        snapshot(driver.arena),
        driver.arena.state_floor,
        None if moves is None else dict(moves.pending),
        dict(coordinator.short_memory_counts),
        driver.arena.refusing_new,
        tuple(_tables(m.req_to_blocks) for m in coordinator.single_type_managers),
    )


def _tables(req_to_blocks) -> dict[str, list[int]]:
    """Block ids per request (upstream's managers keep a default dict that a
    lookup of an unknown request fills with an empty list)."""
    return {
        rid: [b.block_id for b in blocks]
        for rid, blocks in req_to_blocks.items()
        if blocks
    }


def _count(driver: Driver, request_id: str, **args) -> int:
    groups = len(driver.coordinator.single_type_managers)
    return driver.coordinator.get_num_blocks_to_allocate(
        request_id=request_id,
        new_computed_blocks=tuple([] for _ in range(groups)),
        num_encoder_tokens=0,
        **args,
    )


def test_counting_a_waiting_request_twice_moves_no_boundary(monkeypatch):
    """The admission-reserve arena (24 blocks, token ids 1..19, state ids
    20..23, one request running): a waiting 5-block prompt with a reserve of
    6 needs the boundary moved by two free state blocks. Counted twice, the
    answer is the same and nothing moved; allocated, the move happens."""
    use_pooled_manager(monkeypatch)
    driver = Driver(arena_blocks=24, max_num_seqs=2)
    running = driver.request("running", _one_off(10 * BLOCK, 1))
    assert driver.admit(running) == 0
    coordinator = driver.coordinator
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    tokens = 5 * BLOCK
    args = dict(
        num_tokens=tokens,
        total_computed_tokens=0,
        num_local_computed_tokens=0,
        num_tokens_main_model=tokens,
    )
    before = _everything(driver)
    first = coordinator.admit("waiting", tokens, ([], []), 0, 0, 0, tokens, reserve=6)
    second = coordinator.admit("waiting", tokens, ([], []), 0, 0, 0, tokens, reserve=6)
    assert first == second and first is not None
    assert first.boundary.target == driver.arena.state_floor + 2
    assert first.token_blocks == 5 and first.boundary.token_gain == 2
    # upstream's count has no reserve: the 5 blocks fit, nothing to move
    assert _count(driver, "waiting", **args) == _count(driver, "waiting", **args) == 5
    assert _everything(driver) == before
    driver.manager.watermark_blocks = 6
    assert driver.admit(waiting) == 0
    assert driver.arena.token_pool.owned_ids == range(1, 22)
    assert driver.arena.token_pool.get_num_free_blocks() == 6


def test_counting_a_crossing_in_place_twice_changes_nothing(monkeypatch):
    """``test_eviction``'s crossing: a 129-token prompt at its edge (token
    128) can only advance its state in place. Counted twice: the same token
    block, nothing advanced or counted; allocated: one crossing in place."""
    use_pooled_manager(monkeypatch)
    driver = Driver()
    monkeypatch.setattr(driver.arena.boundary, "_recency_target", lambda *a: None)
    driver.share(3)
    long = driver.request("long", _one_off(8 * BLOCK + 1, 7))
    assert driver.admit(long) == 0
    args = dict(
        num_tokens=8 * BLOCK + 1,
        total_computed_tokens=8 * BLOCK,
        num_local_computed_tokens=8 * BLOCK,
        num_tokens_main_model=8 * BLOCK + 1,
        prefill_end=8 * BLOCK,
    )
    before = _everything(driver)
    counts = [_count(driver, "long", **args) for _ in range(2)]
    assert counts == [1, 1]
    assert _everything(driver) == before
    assert driver.coordinator.short_memory_counts["state_in_place"] == 0
    assert driver.step(long)
    assert driver.coordinator.short_memory_counts["state_in_place"] == 1
    check_invariants(driver.arena)


def test_a_refused_count_changes_nothing(monkeypatch):
    """A prompt longer than the arena can hold is refused by every count
    (one more block than the token pool has free), and nothing moves."""
    use_pooled_manager(monkeypatch)
    driver = Driver()
    before = _everything(driver)
    tokens = 40 * BLOCK
    args = dict(
        num_tokens=tokens,
        total_computed_tokens=0,
        num_local_computed_tokens=0,
        num_tokens_main_model=tokens,
    )
    free_now = driver.arena.token_pool.get_num_free_blocks()
    assert _count(driver, "huge", **args) == free_now + 1
    assert _count(driver, "huge", **args) == free_now + 1
    assert _everything(driver) == before
