"""Admission with the growth reserve moves the arena's boundary for it.

The scheduler keeps a growth reserve of token blocks free for the running
requests (upstream's watermark, ``PooledSchedulerMixin.growth_reserve``).
A waiting request is admitted only with the reserve free beyond its own
blocks; the arena's admission plans for both, so the boundary moves for the
reserve too where the state pool holds free blocks the token pool could
take. The plan is ``test_eviction``'s with ``max_num_seqs`` 2: a 24-block
arena, token pool ids 1..19, state pool ids 20..23.
"""

from __future__ import annotations

import pytest
from test_eviction import BLOCK, Driver, _one_off, use_pooled_manager

RESERVE = 6


@pytest.fixture
def driver(monkeypatch):
    use_pooled_manager(monkeypatch)
    driver = Driver(arena_blocks=24, max_num_seqs=2)
    assert driver.arena.token_pool.owned_ids == range(1, 20)
    assert driver.arena.state_pool.owned_ids == range(20, 24)
    # one request runs: 10 token blocks, one state block (the farthest, 23)
    running = driver.request("running", _one_off(10 * BLOCK, 1))
    assert driver.admit(running) == 0
    assert driver.arena.token_pool.get_num_free_blocks() == 9
    assert driver.arena.state_pool.get_num_free_blocks() == 3
    driver.manager.watermark_blocks = RESERVE
    return driver


def test_a_waiting_request_is_admitted_with_the_reserve_from_the_state_pool(driver):
    """5 blocks of its own plus the reserve of 6 are 2 more than the token
    pool's 9 free: the boundary moves by 2 free state blocks and the request
    runs, leaving the reserve free."""
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    assert driver.admit(waiting) == 0
    token = driver.arena.token_pool
    assert token.owned_ids == range(1, 22)
    assert token.get_num_free_blocks() == RESERVE
    assert driver.arena.state_pool.owned_ids == range(22, 24)
    assert driver.arena.state_pool.get_num_free_blocks() == 0


def test_without_a_reserve_nothing_moves(driver):
    """No reserve: the 5 blocks fit in the token pool's 9 free ones."""
    driver.manager.watermark_blocks = 0
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    assert driver.admit(waiting) == 0
    assert driver.arena.token_pool.owned_ids == range(1, 20)
    assert driver.arena.token_pool.get_num_free_blocks() == 4


def test_the_reserve_never_takes_state_blocks_the_request_needs(driver):
    """With the state pool's free blocks all needed (a reserve that would
    take them), the request is refused and nothing moves."""
    driver.manager.watermark_blocks = RESERVE + 3
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    assert driver.admit(waiting) is None
    assert driver.arena.token_pool.owned_ids == range(1, 20)
    assert driver.arena.state_pool.owned_ids == range(20, 24)
