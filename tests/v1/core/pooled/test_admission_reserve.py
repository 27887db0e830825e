"""Admission with the growth reserve moves the arena's boundary for it.

The scheduler keeps a growth reserve of token blocks free for the running
requests (upstream's watermark, ``PooledSchedulerMixin.growth_reserve``).
Upstream checks it against the token pool's free blocks after the
coordinator has secured the request's own blocks, so a coordinator that moved
the boundary only for those would refuse the request while the state pool
holds free blocks the token pool could take. The plan is ``test_eviction``'s
with ``max_num_seqs`` 2: a 24-block arena, token pool ids 1..19, state pool
ids 20..23.
"""

from __future__ import annotations

import pytest
from test_eviction import BLOCK, Driver, _one_off
from vllm.v1.core import kv_cache_manager

from vllm_hybrid.v1.core.kv_cache_coordinator import get_kv_cache_coordinator

RESERVE = 6


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setattr(
        kv_cache_manager, "get_kv_cache_coordinator", get_kv_cache_coordinator
    )
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
    driver.coordinator.admission_reserve = RESERVE
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    assert driver.admit(waiting) == 0
    token = driver.arena.token_pool
    assert token.owned_ids == range(1, 22)
    assert token.get_num_free_blocks() == RESERVE
    assert driver.arena.state_pool.owned_ids == range(22, 24)
    assert driver.arena.state_pool.get_num_free_blocks() == 0


def test_without_the_reserve_in_admission_the_watermark_refuses_it(driver):
    """The coordinator not told the reserve secures the 5 blocks only (no
    move), and upstream's watermark check then refuses the request."""
    driver.coordinator.admission_reserve = 0
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    assert driver.admit(waiting) is None
    assert driver.arena.token_pool.owned_ids == range(1, 20)
    assert driver.arena.token_pool.get_num_free_blocks() == 9


def test_the_reserve_never_takes_state_blocks_the_request_needs(driver):
    """With the state pool's free blocks all needed (a reserve that would
    take them), admission falls back to the request's own blocks and the
    watermark refuses: nothing moves."""
    driver.coordinator.admission_reserve = RESERVE + 3
    driver.manager.watermark_blocks = RESERVE + 3
    waiting = driver.request("waiting", _one_off(5 * BLOCK, 2))
    assert driver.admit(waiting) is None
    assert driver.arena.token_pool.owned_ids == range(1, 20)
    assert driver.arena.state_pool.owned_ids == range(20, 24)
