"""The eviction order (``pooled/policy/eviction.py``) as requests see it.

Cache entries that served ``PROTECT_AFTER_HITS`` prefix hits rest in a
protected segment of their pool's free queue, handed out after every clean
and every other cached block. Admission first serves a request without
touching that segment, then lets a running request cross its state block edge
in place (losing a checkpoint that has served no hit yet), and only then
evicts a protected entry.

The tests below drive upstream's ``KVCacheManager`` over a pooled plan the
way the scheduler does (chunks end on block edges, a new step before each
allocation) and count what hits afterwards. The plan has one attention and
one state layer of 8 KiB per block each, 16-token blocks, ``max_num_seqs``
1: a 16-block arena whose token pool owns ids 1..13 and whose state pool owns
ids 14 and 15. The hypothesis machine in ``test_arena.py`` checks the arena
side of the segments.
"""

from __future__ import annotations

import random

import pytest
import torch
from pooled_invariants import (
    cached_ids,
    check_invariants,
    clean_ids,
    ensure,
    protected_ids,
)
from test_arena import cache, free_order, make_arena
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_manager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import Request

from vllm_hybrid.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm_hybrid.v1.core.pooled.layers import split_layers
from vllm_hybrid.v1.core.pooled.planner import PooledBudget, plan_pooled_kv_cache
from vllm_hybrid.v1.core.pooled.policy import eviction
from vllm_hybrid.v1.core.pooled.policy.eviction import (
    PROTECT_AFTER_HITS,
    Entry,
    Place,
    Reach,
)
from vllm_hybrid.v1.core.pooled.spec import PoolKind

BLOCK = 16
MAX_LEN = 12 * BLOCK
#: A shared prefix of four blocks (a system prompt).
SHARED = list(range(1, 4 * BLOCK + 1))


# ---------------------------------------------------------------------------
# The segments of one pool
# ---------------------------------------------------------------------------


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
    assert protected_ids(queue) == [4]
    # clean blocks, then the LRU of ordinary entries, then protected ones
    assert free_order(pool)[-3:] == [5, 3, 4]
    assert queue.policy.hit_counts() == {3: 1, 4: 2}
    check_invariants(arena)
    # reused (evicted) it starts over
    pool.evict_blocks({4})
    assert protected_ids(queue) == [] and queue.policy.hit_counts() == {3: 1}
    check_invariants(arena)


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
    assert ensure(arena.boundary, 0, free, reach=Reach.SPARE_PROTECTED)
    assert arena.state_floor == floor - 1
    got = pool.get_new_blocks(free)
    assert block not in got
    assert pool.free_block_queue.is_protected(block) and block.block_hash is not None
    check_invariants(arena)
    # with nothing left to spare it, it goes like any cached block
    pool.free_blocks(got)
    everything = pool.get_num_free_blocks() + arena.token_pool.get_num_free_blocks()
    assert not ensure(arena.boundary, 0, everything, reach=Reach.SPARE_PROTECTED)


def _rivals(policy) -> dict:
    kinds = (Entry.PREFILL_LAST, Entry.PROMPT)
    return {kind: policy.rival_hits[kind] for kind in kinds}


def _three_free_entries(names: tuple[bytes, bytes, bytes], freed: tuple[int, ...]):
    """A small arena's token pool (plain LRU in its cached segment, where
    the state pool picks among its least recent by position) with three
    cached blocks named ``names``, freed in the order ``freed`` (indices)."""
    arena = make_arena()
    pool = arena.token_pool
    blocks = pool.get_new_blocks(3)
    for block, name in zip(blocks, names, strict=True):
        cache(pool, block, name)
    pool.free_blocks([blocks[i] for i in freed])
    return arena, pool, blocks


def test_turn_ends_are_ranked_like_any_entry_while_they_serve_more_hits():
    """A turn end goes to the head of its segment until turn ends served more
    hits than prefill checkpoints; then it is filed in LRU order."""
    arena, pool, (end, prefill, other) = _three_free_entries(
        (b"end", b"prefill", b"other"), (2, 1, 0)
    )
    queue, policy = pool.free_block_queue, pool.free_block_queue.policy
    eviction.rank_entry(pool, prefill, Entry.PREFILL)
    eviction.rank_entry(pool, end, Entry.TURN_END)
    # no hits yet: both at the head, the last filed first
    assert cached_ids(queue)[:2] == [end.block_id, prefill.block_id]
    # a follow-up hits the turn end: the next one is filed in LRU order
    pool.touch([end])
    pool.free_blocks([end])
    assert policy.rival_hits[Entry.TURN_END] == 1.0
    eviction.rank_entry(pool, end, Entry.TURN_END)
    assert cached_ids(queue) == [prefill.block_id, other.block_id, end.block_id]
    # two hits on the prefill checkpoint: turn ends go to the head again
    for _ in range(2):
        pool.touch([prefill])
        pool.free_blocks([prefill])
        eviction.rank_entry(pool, prefill, Entry.PREFILL)
    eviction.rank_entry(pool, end, Entry.TURN_END)
    assert cached_ids(queue)[0] == end.block_id
    check_invariants(arena)


def test_a_prompts_own_and_last_prefill_checkpoints_rank_by_their_hits():
    """Both kinds are ordinary (tail) entries until one served more hits
    lately: the other's entries then go first."""
    arena, pool, (own, last, other) = _three_free_entries(
        (b"own", b"last", b"other"), (1, 0, 2)
    )
    queue, policy = pool.free_block_queue, pool.free_block_queue.policy
    eviction.rank_entry(pool, last, Entry.PREFILL_LAST)
    eviction.rank_entry(pool, own, Entry.PROMPT)
    # no hits yet: both in LRU order, behind the entry freed before them
    assert cached_ids(queue) == [other.block_id, last.block_id, own.block_id]
    # a follow-up hits the last prefill checkpoint: own checkpoints go first
    pool.touch([last])
    pool.free_blocks([last])
    eviction.rank_entry(pool, last, Entry.PREFILL_LAST)
    assert _rivals(policy) == {Entry.PREFILL_LAST: 1.0, Entry.PROMPT: 0.0}
    eviction.rank_entry(pool, own, Entry.PROMPT)
    assert cached_ids(queue) == [own.block_id, other.block_id, last.block_id]
    # two resent prompts hit their own checkpoint: last ones go first now
    for _ in range(2):
        pool.touch([own])
        pool.free_blocks([own])
    assert _rivals(policy) == {Entry.PREFILL_LAST: 1.0, Entry.PROMPT: 2.0}
    eviction.rank_entry(pool, last, Entry.PREFILL_LAST)
    assert cached_ids(queue)[0] == last.block_id
    # evicted, a block's kind is forgotten: its later hits count for nobody
    pool.evict_blocks({last.block_id})
    cache(pool, last, b"reused")
    pool.touch([last])
    assert policy.rival_hits[Entry.PREFILL_LAST] == 1.0
    check_invariants(arena)


def test_rival_hits_are_halved_so_recent_traffic_decides():
    policy = eviction.EvictionPolicy()
    pool = make_arena().state_pool
    own, last = pool.get_new_blocks(2)
    cache(pool, own, b"own")
    cache(pool, last, b"last")
    assert policy.rank(own, Entry.PROMPT) is Place.TAIL
    assert policy.rank(last, Entry.PREFILL_LAST) is Place.TAIL
    for _ in range(400):
        policy.record_hit(own)
    assert policy.rank(last, Entry.PREFILL_LAST) is Place.HEAD
    assert policy.rank(own, Entry.PROMPT) is Place.TAIL
    for _ in range(400):
        policy.record_hit(last)
    hits = policy.rival_hits
    # halved each time the sum passed the half-life, so it stays below it
    assert sum(hits.values()) <= eviction.RIVAL_HALF_LIFE_HITS
    assert hits[Entry.PREFILL_LAST] > hits[Entry.PROMPT]
    assert policy.rank(last, Entry.PREFILL_LAST) is Place.TAIL
    assert policy.rank(own, Entry.PROMPT) is Place.HEAD
    # kinds outside the rivals keep their place whatever the hits
    assert policy.rank(own, Entry.TURN_END) is Place.HEAD


# ---------------------------------------------------------------------------
# Requests through upstream's KV cache manager
# ---------------------------------------------------------------------------


def _plan(arena_blocks: int, max_num_seqs: int):
    specs = {
        "model.layers.0": MambaSpec(
            block_size=BLOCK,
            shapes=((2048,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        ),
        "model.layers.1": FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32
        ),
    }
    split = split_layers(specs)
    assert split.token.block_bytes == split.state.block_bytes == 8192
    budget = PooledBudget(
        arena_bytes=arena_blocks * 8192,
        max_model_len=MAX_LEN,
        max_num_seqs=max_num_seqs,
        null_blocks_overlap=True,
    )
    return plan_pooled_kv_cache(split, budget)


def use_pooled_manager(monkeypatch) -> None:
    """Upstream's ``KVCacheManager`` builds pooled coordinators and runs the
    overlay's allocation over them, as the registry has it."""
    from vllm_hybrid.v1.core.kv_cache_manager import allocate_slots

    monkeypatch.setattr(
        kv_cache_manager, "get_kv_cache_coordinator", get_kv_cache_coordinator
    )
    monkeypatch.setattr(
        kv_cache_manager.KVCacheManager, "allocate_slots", allocate_slots
    )


class Driver:
    """Upstream's ``KVCacheManager`` over a pooled plan, driven the way the
    scheduler drives it."""

    def __init__(
        self,
        arena_blocks: int = 16,
        max_num_seqs: int = 1,
        prefill_interval: int = 0,
        prefill_anchor: int = 0,
    ) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        plan = _plan(arena_blocks, max_num_seqs)
        # the engine's defaults: states kept only where they can serve a hit
        plan.prefix_cache_retention_interval = 0
        plan.prefill_checkpoint_interval = prefill_interval
        plan.prefill_checkpoint_anchor = prefill_anchor
        self.manager = kv_cache_manager.KVCacheManager(
            plan,
            max_model_len=MAX_LEN,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )
        self.coordinator = self.manager.coordinator
        self.arena = self.coordinator.arena

    def request(self, name: str, tokens: list[int]) -> Request:
        params = SamplingParams(max_tokens=8)
        return Request(name, tokens, params, None, block_hasher=self.hasher)

    def admit(self, request: Request) -> int | None:
        """Schedule the prompt up to its last block edge (or all of it after
        a hit there); the tokens it hit, or None if refused."""
        self.manager.new_step_starts()
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        edge = request.num_tokens // BLOCK * BLOCK
        chunk = edge - hit if edge > hit else request.num_tokens - hit
        if self.manager.allocate_slots(request, chunk, hit, blocks) is None:
            return None
        request.num_computed_tokens = hit + chunk
        return hit

    def step(self, request: Request, chunk: int | None = None) -> bool:
        """Schedule ``chunk`` more tokens (the rest of the prompt by
        default); whether it was admitted."""
        self.manager.new_step_starts()
        rest = request.num_tokens - request.num_computed_tokens
        chunk = rest if chunk is None else chunk
        if self.manager.allocate_slots(request, chunk) is None:
            return False
        request.num_computed_tokens += chunk
        return True

    def serve(self, request: Request) -> int:
        """Run a prompt to its end and free it; the tokens it hit."""
        hit = self.admit(request)
        assert hit is not None
        if request.num_computed_tokens < request.num_tokens:
            assert self.step(request)
        self.manager.free(request)
        return hit

    def share(self, users: int) -> None:
        """``users`` requests of SHARED plus one token each, one after the
        other: the first computes the prefix, the others hit it."""
        for i in range(users):
            hit = self.serve(self.request(f"shared{i}", [*SHARED, 100 + i]))
            assert hit == (0 if i == 0 else len(SHARED))

    def hits_shared(self) -> int:
        return self.serve(self.request("probe", [*SHARED, 99]))


def _one_off(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 900) for _ in range(length)]


@pytest.fixture
def driver(monkeypatch):
    # the pooled coordinators, as the overlay's registry installs them
    use_pooled_manager(monkeypatch)
    return Driver()


@pytest.mark.parametrize("protect_after", [PROTECT_AFTER_HITS, 10**9])
def test_a_shared_prefix_outlives_a_burst_of_one_off_prompts(
    monkeypatch, protect_after
):
    """Three requests share a 64-token prefix, then five one-off prompts of
    seven blocks each pass through the 11 token blocks (room for two
    requests' states leaves the state pool 4 blocks). Protected after its two
    hits, the prefix still hits 64 tokens; in one LRU with the one-offs it is
    the oldest entry and the first one-off evicts it."""
    use_pooled_manager(monkeypatch)
    monkeypatch.setattr(eviction, "PROTECT_AFTER_HITS", protect_after)
    driver = Driver(max_num_seqs=2)
    assert driver.arena.token_capacity == 11
    driver.share(3)
    token_queue = driver.arena.token_pool.free_block_queue
    protected = protected_ids(token_queue)
    assert protected == ([4, 3, 2, 1] if protect_after == 2 else [])
    for i in range(5):
        driver.serve(driver.request(f"once{i}", _one_off(6 * BLOCK + 1, i)))
    assert driver.hits_shared() == (64 if protect_after == 2 else 0)
    check_invariants(driver.arena)


def test_a_running_request_crosses_in_place_before_a_protected_entry_goes(
    monkeypatch,
):
    """After the shared prefix, the state pool holds its protected checkpoint
    and one clean block; a 129-token prompt takes the clean one and eight
    token blocks, leaving one token block free. At its edge (token 128) it
    needs a token and a state block: the boundary cannot give the state pool
    that last token block, so the request advances its state in place. Its
    own checkpoint at 128 is the one lost; the prefix still hits 64.

    The boundary moves on demand only here: by recency the state pool would
    have grown into a clean token block while the prefix was shared
    (``test_arena_split.py``), and the arena would differ from the start."""
    use_pooled_manager(monkeypatch)
    driver = Driver()
    # no recency moves: the boundary moves only where a pool is short
    monkeypatch.setattr(driver.arena.boundary, "_recency_target", lambda *a: None)
    driver.share(3)
    state_queue = driver.arena.state_pool.free_block_queue
    assert protected_ids(state_queue) == [15] and clean_ids(state_queue) == [14]
    long = driver.request("long", _one_off(8 * BLOCK + 1, 7))
    assert driver.admit(long) == 0
    assert driver.step(long)
    assert driver.coordinator.short_memory_counts == {
        "state_in_place": 1,
        "edges_in_place": 0,
        "relocations": 0,
    }
    assert driver.arena.state_capacity == 2  # the boundary did not move
    driver.manager.free(long)
    assert driver.hits_shared() == 64
    again = driver.request("again", [*long.all_token_ids[: 8 * BLOCK], 5])
    assert driver.admit(again) == 0  # its checkpoint at 128 was lost
    check_invariants(driver.arena)


def test_a_new_request_evicts_a_protected_entry_when_nothing_else_serves(driver):
    """The same arena, a second request instead of a crossing: a new request
    cannot advance a state in place, so once no other block serves it the
    protected checkpoint goes and the prefix hits nothing."""
    driver.share(3)
    first = driver.request("first", _one_off(8 * BLOCK, 7))
    assert driver.admit(first) == 0  # 8 token blocks, state block 14
    second = driver.request("second", _one_off(BLOCK, 8))
    assert driver.admit(second) == 0  # token block 13, state block 15
    assert driver.coordinator.short_memory_counts == {
        "state_in_place": 0,
        "edges_in_place": 0,
        "relocations": 0,
    }
    assert protected_ids(driver.arena.state_pool.free_block_queue) == []
    for request in (first, second):
        driver.manager.free(request)
    assert driver.hits_shared() == 0
    check_invariants(driver.arena)


def test_a_request_nothing_serves_is_refused_and_changes_nothing(driver):
    driver.share(3)
    first = driver.request("first", _one_off(8 * BLOCK, 7))
    assert driver.admit(first) == 0
    before = (driver.arena.boundary_bytes, driver.arena.token_capacity)
    # six token blocks: five are free, four of them protected, and the state
    # block next to the boundary is in use
    second = driver.request("second", _one_off(6 * BLOCK, 8))
    assert driver.admit(second) is None
    assert (driver.arena.boundary_bytes, driver.arena.token_capacity) == before
    state_queue = driver.arena.state_pool.free_block_queue
    assert protected_ids(state_queue) == [15]
    assert protected_ids(driver.arena.token_pool.free_block_queue) == [4, 3, 2, 1]
    driver.manager.free(first)
    assert driver.hits_shared() == 64


def _decode_to(driver: Driver, request: Request, tokens: int) -> None:
    """One token a step (an output token once the prompt is computed)."""
    while request.num_computed_tokens < tokens:
        if request.num_computed_tokens >= request.num_tokens:
            request.append_output_token_ids(7)
        assert driver.step(request, 1)


def _state_blocks(driver: Driver, request: Request) -> list[int]:
    (state,) = [
        m
        for m, kind in zip(
            driver.coordinator.single_type_managers,
            driver.coordinator.admitter.kinds,
            strict=True,
        )
        if kind is PoolKind.STATE
    ]
    return [b.block_id for b in state.req_to_blocks[request.request_id]]


def test_a_state_next_to_the_boundary_moves_while_new_requests_are_refused(
    monkeypatch,
):
    """Decode crosses the edges no checkpoint keeps in place (same block,
    no copy), except while the arena refuses a new request: then a running
    state block next to the boundary (all four state ids here are within
    RELOCATE_NEAR_BOUNDARY of the lowest) takes a fresh block, one copy, so
    the old one can free and the boundary move. Once a new request is
    admitted again, edges go back in place."""
    use_pooled_manager(monkeypatch)
    assert eviction.RELOCATE_NEAR_BOUNDARY >= 4
    driver = Driver(max_num_seqs=2)
    counts = driver.coordinator.short_memory_counts
    running = driver.request("running", _one_off(2 * BLOCK + 1, 1))
    assert driver.admit(running) == 0
    _decode_to(driver, running, 3 * BLOCK + 1)
    assert counts["edges_in_place"] == 1 and counts["relocations"] == 0
    held = _state_blocks(driver, running)[-1]

    too_long = driver.request("too_long", _one_off(11 * BLOCK, 2))
    assert driver.admit(too_long) is None
    _decode_to(driver, running, 4 * BLOCK + 1)
    assert counts["relocations"] == 1
    assert counts["edges_in_place"] == 1
    moved = _state_blocks(driver, running)[-1]
    assert moved != held

    short = driver.request("short", _one_off(BLOCK, 3))
    assert driver.admit(short) == 0
    _decode_to(driver, running, 5 * BLOCK + 1)
    assert counts["edges_in_place"] == 2 and counts["relocations"] == 1
    assert _state_blocks(driver, running)[-1] == moved
    check_invariants(driver.arena)
