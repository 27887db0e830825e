"""Coordinated prefix-cache eviction across the arena's pools.

Setup used by the example tests: 16-token hash blocks, one full-attention
group (id 0, 16-token blocks) in the token pool and one state group (id 1) in
the state pool. A request's chain is a list of per-block hashes; a state
checkpoint at ``N`` tokens needs the attention blocks of those ``N`` tokens.
"""

from __future__ import annotations

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
from pooled_invariants import cached_ids, check_invariants, ensure, needed_by, needs
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

from vllm_hybrid.config.hybrid_kv import HybridKVOptions
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.links import CheckpointLinks
from vllm_hybrid.v1.core.pooled.policy.positions import CheckpointPolicy
from vllm_hybrid.v1.core.pooled.retention import TurnEndRetentionMixin
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PoolKind

HBS = 16
LAYOUT = ArenaLayout(
    arena_bytes=400,
    token_block_bytes=4,
    state_block_bytes=10,
    min_token_blocks=2,
    min_state_blocks=2,
    initial_boundary=200,
)


def make_arena(coupled: bool = True, layout: ArenaLayout = LAYOUT) -> KVArena:
    arena = KVArena(layout, enable_caching=True, hash_block_size=HBS)
    if coupled:
        arena.couple_prefix_caches({0: HBS})
    return arena


def chain(name: str, n: int) -> list[BlockHash]:
    return [BlockHash(f"{name}{i}".encode()) for i in range(n)]


def tkey(h: BlockHash):
    return make_block_hash_with_group_id(h, 0)


def skey(h: BlockHash):
    return make_block_hash_with_group_id(h, 1)


class Req:
    """Blocks one request holds: attention blocks and state blocks by index
    (None: a null slot, as align mode leaves between checkpoints)."""

    def __init__(self, arena: KVArena, hashes: list[BlockHash]) -> None:
        self.arena = arena
        self.request = SimpleNamespace(block_hashes=hashes)
        self.attn: list[KVCacheBlock] = []
        self.state: list[KVCacheBlock] = []
        #: blocks of the prompt; later ones were decoded
        self.prompt_blocks = 0
        #: index of the state block at the latest decode edge
        self.last_decode: int | None = None

    def compute(self, n_blocks: int, checkpoints: list[int]) -> None:
        """Allocate and cache ``n_blocks`` attention blocks and a state block
        at each checkpoint index (state for ``(i + 1) * 16`` tokens)."""
        tok, sta = self.arena.token_pool, self.arena.state_pool
        self.attn = tok.get_new_blocks(n_blocks)
        tok.cache_full_blocks(self.request, self.attn, 0, n_blocks, HBS, 0)
        self.state = [sta.null_block] * n_blocks
        for i in checkpoints:
            self.state[i] = sta.get_new_blocks(1)[0]
        sta.cache_full_blocks(self.request, self.state, 0, n_blocks, HBS, 1)

    def free(self) -> None:
        self.arena.token_pool.free_blocks(reversed(self.attn))
        real = [b for b in self.state if not b.is_null]
        self.arena.state_pool.free_blocks(reversed(real))


def computed(
    n_blocks: int, checkpoints: list[int], free: bool = True
) -> tuple[KVArena, list[BlockHash], Req]:
    """A coupled arena with one request over the chain "r0", "r1", ... that
    computed ``n_blocks`` blocks with those checkpoints (and finished)."""
    arena = make_arena()
    hashes = chain("r", n_blocks)
    req = Req(arena, hashes)
    req.compute(n_blocks, checkpoints)
    if free:
        req.free()
    return arena, hashes, req


def cached(pool, keys) -> list[bool]:
    return [pool.cached_block_hash_to_block.get_one_block(k) is not None for k in keys]


def test_links_unit():
    links = CheckpointLinks({0: 16}, 16)
    a, b = chain("a", 3), chain("b", 3)

    def cached(key):
        return True

    # a checkpoint needs the full attention blocks wholly inside its prefix
    links.link_if_cached(skey(a[1]), a, 40, cached)
    assert needs(links) == {skey(a[1]): (tkey(a[0]), tkey(a[1]))}
    links.link_if_cached(skey(a[2]), a, 48, cached)
    links.link_if_cached(skey(b[0]), b, 16, cached)
    # Forgetting the deeper checkpoint orphans only the block it alone needed.
    assert links.forget_state(skey(a[2])) == [tkey(a[2])]
    # Losing an attention block breaks the checkpoint and orphans its prefix.
    states, orphans = links.forget_token(tkey(a[0]))
    assert states == [skey(a[1])] and orphans == [tkey(a[1])]
    assert links.broken == {skey(a[1])}
    assert needs(links) == {skey(b[0]): (tkey(b[0]),)}
    assert needed_by(links) == {tkey(b[0]): {skey(b[0])}}
    # already linked: stays linked, even when asked with a prefix not cached
    links.link_if_cached(skey(b[0]), b, 16, lambda key: False)
    assert skey(b[0]) not in links.broken
    # not linked yet and a block of its prefix not cached: broken from the start
    links.link_if_cached(skey(b[1]), b, 32, lambda key: key != tkey(b[1]))
    assert skey(b[1]) in links.broken and not links.is_linked(skey(b[1]))


def test_tail_past_last_checkpoint_is_evicted_on_free():
    arena, hashes, req = computed(4, [1])  # checkpoint at 32 tokens
    tok = arena.token_pool
    assert cached(tok, [tkey(h) for h in hashes]) == [True, True, False, False]
    assert sorted(cached_ids(tok.free_block_queue)) == sorted(
        b.block_id for b in req.attn[:2]
    )
    assert arena.coupling.evictions == {"token": 2, "state": 0}
    check_invariants(arena)


def test_uncoupled_arena_keeps_everything():
    arena = make_arena(coupled=False)
    hashes = chain("r", 4)
    req = Req(arena, hashes)
    req.compute(4, checkpoints=[1])
    req.free()
    assert cached(arena.token_pool, [tkey(h) for h in hashes]) == [True] * 4
    check_invariants(arena)


def test_evicting_a_checkpoint_evicts_the_blocks_only_it_needed():
    arena, hashes, req = computed(4, [1, 3])  # checkpoints at 32 and 64 tokens
    tok, sta = arena.token_pool, arena.state_pool
    assert cached(tok, [tkey(h) for h in hashes]) == [True] * 4
    sta.evict_blocks({req.state[3].block_id})
    assert cached(tok, [tkey(h) for h in hashes]) == [True, True, False, False]
    sta.evict_blocks({req.state[1].block_id})
    assert cached(tok, [tkey(h) for h in hashes]) == [False] * 4
    assert cached_ids(tok.free_block_queue) == []
    check_invariants(arena)


def test_evicting_an_attention_block_evicts_the_checkpoints_past_it():
    arena, hashes, req = computed(4, [0, 3])
    tok, sta = arena.token_pool, arena.state_pool
    tok.evict_blocks({req.attn[2].block_id})
    # The 64-token checkpoint lost its prefix; so did blocks 1 and 3, which
    # only it needed. Block 0 and the 16-token checkpoint still make a hit.
    assert cached(sta, [skey(hashes[0]), skey(hashes[3])]) == [True, False]
    assert cached(tok, [tkey(h) for h in hashes]) == [True, False, False, False]
    assert arena.coupling.evictions == {"token": 2, "state": 1}
    check_invariants(arena)


def test_blocks_in_use_are_checked_again_when_freed():
    arena, hashes, holder = computed(2, [1], free=False)
    tok, sta = arena.token_pool, arena.state_pool
    # Free only the attention blocks; the checkpoint stays held.
    tok.free_blocks(reversed(holder.attn))
    tok.evict_blocks({holder.attn[0].block_id})
    assert arena.coupling.links.broken == {skey(hashes[1])}
    assert cached(sta, [skey(hashes[1])]) == [True]  # held: not evicted yet
    sta.free_blocks([holder.state[1]])
    assert cached(sta, [skey(hashes[1])]) == [False]
    assert cached_ids(sta.free_block_queue) == []
    check_invariants(arena)


def test_a_hit_keeps_shared_prefix_alive():
    """Two requests share two blocks; each has its own checkpoint."""
    arena = make_arena()
    shared = chain("p", 2)
    first = Req(arena, shared + chain("x", 1))
    first.compute(3, checkpoints=[1, 2])
    first.free()
    second = Req(arena, shared + chain("y", 1))
    tok, sta = arena.token_pool, arena.state_pool
    hit = tok.get_cached_block(shared[0], [0]) + tok.get_cached_block(shared[1], [0])
    tok.touch(hit)
    extra = tok.get_new_blocks(1)
    second.attn = hit + extra
    tok.cache_full_blocks(second.request, second.attn, 2, 3, HBS, 0)
    second.state = [sta.null_block, sta.null_block, sta.get_new_blocks(1)[0]]
    sta.cache_full_blocks(second.request, second.state, 2, 3, HBS, 1)
    second.free()
    # Dropping the first request's deep checkpoint orphans only x0.
    sta.evict_blocks({first.state[2].block_id})
    keys = [tkey(h) for h in shared + chain("x", 1) + chain("y", 1)]
    assert cached(tok, keys) == [True, True, False, True]
    check_invariants(arena)


def test_resetting_one_pool_keeps_the_links_consistent():
    arena, hashes, req = computed(3, [0, 2], free=False)
    tok, sta = arena.token_pool, arena.state_pool
    sta.free_blocks(reversed([b for b in req.state if not b.is_null]))
    # The token pool is busy; only the state pool can be reset.
    assert not arena.reset_prefix_cache()
    assert sta.reset_prefix_cache()
    assert needs(arena.coupling.links) == {} and needed_by(arena.coupling.links) == {}
    tok.free_blocks(reversed(req.attn))
    # No checkpoint is left, so no attention block can be hit: all evicted.
    assert cached_ids(tok.free_block_queue) == []
    check_invariants(arena)
    # The other way round: a busy state pool, the token pool reset.
    req = Req(arena, hashes)
    req.compute(3, checkpoints=[2])
    tok.free_blocks(reversed(req.attn))
    assert tok.reset_prefix_cache()
    assert arena.coupling.links.broken == {skey(hashes[2])}
    sta.free_blocks([req.state[2]])
    assert cached_ids(sta.free_block_queue) == []
    assert arena.coupling.links.broken == set()
    check_invariants(arena)


def test_reset_clears_links():
    arena, _, _ = computed(2, [1])
    assert arena.reset_prefix_cache()
    assert needs(arena.coupling.links) == {} and needed_by(arena.coupling.links) == {}
    check_invariants(arena)


def test_a_pool_records_its_events_and_the_coupling_acts_when_it_settles():
    """Called around their handles, the pools only record what happened;
    the coupling evicts the dead tail when it handles the record."""
    arena = make_arena()
    hashes = chain("r", 4)
    req = Req(arena, hashes)
    tok, sta = arena.token_pool.pool, arena.state_pool.pool
    req.attn = tok.get_new_blocks(4)
    tok.cache_full_blocks(req.request, req.attn, 0, 4, HBS, 0)
    req.state = [sta.null_block] * 4
    req.state[1] = sta.get_new_blocks(1)[0]
    sta.cache_full_blocks(req.request, req.state, 0, 4, HBS, 1)
    tok.free_blocks(reversed(req.attn))
    coupling = arena.coupling
    # 1 checkpoint key cached (token keys link nothing), 4 token blocks freed
    assert [type(e).__name__ for e in coupling.pending] == [
        "KeyCached",
        "BlocksFreed",
    ]
    assert needs(coupling.links) == {}
    assert cached(tok, [tkey(h) for h in hashes]) == [True] * 4
    with pytest.raises(AssertionError, match="unhandled prefix-cache events"):
        check_invariants(arena)
    coupling.settle(req.request)  # what the handle does after caching
    assert coupling.pending == []
    assert len(needs(coupling.links)[skey(hashes[1])]) == 2
    assert cached(tok, [tkey(h) for h in hashes]) == [True, True, False, False]
    assert coupling.evictions == {"token": 2, "state": 0}
    check_invariants(arena)


def test_eviction_by_ids_counts_what_each_one_made_dead():
    """The handle evicts one id at a time: the second id's block, which the
    first eviction made dead, counts as a coupled eviction, as it does when
    each event is handled the moment it happens (settling once after both
    evictions would count 2 token blocks, not 3)."""
    arena, hashes, req = computed(4, [3])
    tok = arena.token_pool
    tok.evict_blocks({req.attn[0].block_id, req.attn[1].block_id})
    assert cached(tok, [tkey(h) for h in hashes]) == [False] * 4
    assert cached(arena.state_pool, [skey(hashes[3])]) == [False]
    assert arena.coupling.evictions == {"token": 3, "state": 1}
    check_invariants(arena)


def test_the_handle_reads_and_sets_the_pools_own_attributes():
    arena = make_arena()
    handle, pool = arena.token_pool, arena.token_pool.pool
    assert handle.blocks is pool.blocks and handle.side is PoolKind.TOKEN
    original = pool._insert_block_hash
    handle._insert_block_hash = original  # what the simulator's probe does
    assert pool.__dict__["_insert_block_hash"] == original
    assert handle.coupling is arena.coupling and "coupling" not in pool.__dict__
    # a copied attribute set through the handle is renewed on both
    hits: list[object] = []
    handle.touch = hits.append
    handle.touch("block")
    assert pool.touch is handle.touch and hits == ["block"]


def test_coupling_has_no_option():
    """The coupling is always on with prefix caching: the retired switch is
    an unknown option, refused before any engine starts."""
    config = SimpleNamespace(
        additional_config={"hybrid_kv": {"couple_prefix_caches": False}}
    )
    with pytest.raises(ValueError, match=r"Unknown .* \['couple_prefix_caches'\]"):
        HybridKVOptions.from_vllm_config(config)


class Retention(TurnEndRetentionMixin):
    """Turn-end retention's eviction rule alone (upstream's default
    retention interval 0: only semantic checkpoints are kept)."""

    def __init__(self, state_pool) -> None:
        self.retention_interval = 0
        self.single_type_managers = (SimpleNamespace(block_pool=state_pool),)
        self._init_turn_ends(CheckpointPolicy.of(True))


class CoupledArenaMachine(RuleBasedStateMachine):
    """Random requests over a small tree of shared prefixes: compute, decode
    with turn-end retention, free, hit, evict by id, allocate under pressure,
    reset. Invariants: the arena's own, the links agree with both caches, no
    free cached block in either pool is dead (every cached entry can still be
    part of a hit), and each request has at most one decode checkpoint
    cached."""

    def __init__(self) -> None:
        super().__init__()
        self.arena: KVArena | None = None
        self.live: list[Req] = []
        self.held: list[tuple[object, list[KVCacheBlock]]] = []
        self.retention: Retention | None = None
        self.decoded = 0
        #: (block id, key) of decode checkpoints put first in the LRU order
        self.ranked: set[tuple[int, object]] = set()

    @initialize(extra=st.integers(0, 200))
    def build(self, extra):
        layout = ArenaLayout(
            200 + extra, 4, 10, 2, 2, initial_boundary=(200 + extra) // 2
        )
        self.arena = make_arena(layout=layout)
        self.retention = Retention(self.arena.state_pool)

    def _chain(self, data) -> list[BlockHash]:
        # Prefixes from a 2-ary tree of depth 5: many shared prefixes.
        path = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=5))
        return [
            BlockHash(("n" + "".join(map(str, path[: i + 1]))).encode())
            for i in range(len(path))
        ]

    @rule(data=st.data())
    def compute(self, data):
        arena = self.arena
        hashes = self._chain(data)
        n = len(hashes)
        points = data.draw(st.sets(st.integers(0, n - 1), max_size=n), label="ckpt")
        tok, sta = arena.token_pool, arena.state_pool
        if not ensure(arena.boundary, n, len(points)):
            return
        # Like a request: reuse the cached prefix, compute the rest.
        hit: list[KVCacheBlock] = []
        for h in hashes:
            blocks = tok.get_cached_block(h, [0])
            if blocks is None:
                break
            hit += blocks
        keep = data.draw(st.integers(0, len(hit)), label="hit")
        hit = hit[:keep]
        tok.touch(hit)
        req = Req(arena, hashes)
        if tok.get_num_free_blocks() < n - keep or sta.get_num_free_blocks() < len(
            points
        ):
            tok.free_blocks(reversed(hit))
            return
        req.attn = hit + tok.get_new_blocks(n - keep)
        tok.cache_full_blocks(req.request, req.attn, keep, n, HBS, 0)
        req.state = [sta.null_block] * n
        for i in points:
            req.state[i] = sta.get_new_blocks(1)[0]
        sta.cache_full_blocks(req.request, req.state, 0, n, HBS, 1)
        req.prompt_blocks = n
        self.live.append(req)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def decode(self, data):
        """A live request decodes across one more block edge: its new
        attention block and the state at the edge are cached, align mode
        retires the state block of its previous decode edge, and turn-end
        retention evicts that previous decode checkpoint."""
        req = self.live[data.draw(st.integers(0, len(self.live) - 1), label="who")]
        arena = self.arena
        if not ensure(arena.boundary, 1, 1):
            return
        tok, sta = arena.token_pool, arena.state_pool
        n = len(req.attn)
        self.decoded += 1
        req.request.block_hashes.append(BlockHash(f"d{self.decoded}".encode()))
        req.attn.append(tok.get_new_blocks(1)[0])
        tok.cache_full_blocks(req.request, req.attn, n, n + 1, HBS, 0)
        req.state.append(sta.get_new_blocks(1)[0])
        sta.cache_full_blocks(req.request, req.state, n, n + 1, HBS, 1)
        if req.last_decode is not None:
            sta.free_blocks([req.state[req.last_decode]])
            req.state[req.last_decode] = sta.null_block
        req.last_decode = n
        manager = SimpleNamespace(
            block_size=HBS, block_pool=sta, req_to_blocks={id(req): req.state}
        )
        self.retention._supersede(
            0, manager, id(req), (n + 1) * HBS, req.prompt_blocks * HBS
        )

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data):
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        req.free()
        # the request's last decode checkpoint goes first in the LRU order
        latest = self.retention.turn_end_counts.by_request.pop(id(req), None)
        if latest:
            self.retention._rank_turn_ends(latest)
            self.ranked |= {
                (c.block.block_id, c.block_hash) for c in latest.values() if c.ranked
            }

    @rule(data=st.data(), state_side=st.booleans())
    def evict_by_id(self, data, state_side):
        pool = self.arena.state_pool if state_side else self.arena.token_pool
        ids = data.draw(st.sets(st.integers(1, len(pool.blocks) - 1), max_size=3))
        pool.evict_blocks(ids)

    @rule(data=st.data(), state_side=st.booleans(), n=st.integers(1, 8))
    def allocate_under_pressure(self, data, state_side, n):
        """Plain allocations that pop (and so evict) LRU cached blocks."""
        pool = self.arena.state_pool if state_side else self.arena.token_pool
        need = (n, 0) if pool.side is PoolKind.TOKEN else (0, n)
        if not ensure(self.arena.boundary, *need):
            return
        self.held.append((pool, pool.get_new_blocks(n)))

    @precondition(lambda self: bool(self.held))
    @rule()
    def release(self):
        pool, blocks = self.held.pop()
        pool.free_blocks(blocks)

    @rule(whole=st.booleans(), state_side=st.booleans())
    def reset(self, whole, state_side):
        if whole:
            self.arena.reset_prefix_cache()
        else:
            pool = self.arena.state_pool if state_side else self.arena.token_pool
            pool.reset_prefix_cache()

    @invariant()
    def coupled(self):
        if self.arena is not None:
            check_invariants(self.arena)

    @invariant()
    def ranked_checkpoints_are_evicted_first(self):
        """Freed decode checkpoints still cached lead the state pool's LRU
        queue: every other cached block is evicted after them."""
        if self.arena is None:
            return
        pool = self.arena.state_pool
        order = cached_ids(pool.free_block_queue)
        first = [(i, pool.blocks[i].block_hash) in self.ranked for i in order]
        assert first == sorted(first, reverse=True), order

    @invariant()
    def one_decode_checkpoint_per_request(self):
        if self.arena is None:
            return
        for req in self.live:
            decoded = req.request.block_hashes[req.prompt_blocks :]
            assert sum(cached(self.arena.state_pool, map(skey, decoded))) <= 1

    def teardown(self):
        if self.arena is None:
            return
        for req in self.live:
            req.free()
        for pool, blocks in self.held:
            pool.free_blocks(blocks)
        check_invariants(self.arena)
        for pool in (self.arena.token_pool, self.arena.state_pool):
            assert pool.get_num_free_blocks() == pool.owned_capacity


# Examples, seeds and health checks come from the profile (tests/conftest.py).
CoupledArenaMachine.TestCase.settings = settings(stateful_step_count=40)
TestCoupledArenaMachine = CoupledArenaMachine.TestCase
