"""Live token blocks moved off the arena's boundary (``pooled.moves``).

The arena is ``test_arena.SMALL``: token ids 3..11 and state ids 5..9 at the
start; one more state block (state floor 4) takes token ids 10 and 11.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st
from pooled_invariants import check_invariants, ensure
from test_arena import cache, key, make_arena

from vllm_hybrid.config.hybrid_kv import HybridKVOptions
from vllm_hybrid.v1.core.pooled.moves import TokenMoves, new_block_ids_follow
from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin


def _boundary_pinned(arena, free: int = 7):
    """Every token block taken, then ``free`` of the low ones (3..9) freed:
    ids 10 and 11, next to the boundary, stay live (id 11 cached); the state
    pool is full."""
    token = arena.token_pool
    held = token.get_new_blocks(9)
    cache(token, held[8], b"pinned")
    token.free_blocks(held[:free])
    arena.state_pool.get_new_blocks(5)
    return held


def test_live_token_blocks_move_so_that_the_state_pool_can_grow():
    arena = make_arena()
    token = arena.token_pool
    held = _boundary_pinned(arena)
    live = held[7:]
    assert [b.block_id for b in live] == [10, 11]
    assert not ensure(arena.boundary, 0, 1)  # moves not allowed: pinned
    assert arena.state_floor == 5

    heard = []
    arena.allow_token_moves(lambda old, new: heard.append((old, new)))
    assert ensure(arena.boundary, 0, 1)
    assert arena.state_floor == 4 and arena.token_capacity == 7
    assert [b.block_id for b in live] == [3, 4]  # the first free ones
    assert all(token.blocks[b.block_id] is b and b.ref_cnt == 1 for b in live)
    # the prefix-cache entry followed its block
    assert token.blocks_with(key(token, b"pinned")) == [live[1]]
    assert heard == [(10, 3), (11, 4)]
    assert arena.take_token_moves() == {10: 3, 11: 4}
    assert arena.take_token_moves() == {}
    (state,) = arena.state_pool.get_new_blocks(1)
    assert state.block_id == 4
    check_invariants(arena)


def test_nothing_moves_when_too_few_token_blocks_are_free_elsewhere():
    arena = make_arena()
    held = _boundary_pinned(arena, free=1)  # only id 3 free outside
    arena.allow_token_moves()
    assert not ensure(arena.boundary, 0, 1)
    assert [b.block_id for b in held] == list(range(3, 12))
    assert arena.state_floor == 5
    assert arena.take_token_moves() == {}
    check_invariants(arena)


def test_moves_leave_room_for_the_token_need_they_serve_with():
    arena = make_arena()
    _boundary_pinned(arena, free=3)  # ids 3..5 free: two moves leave one
    arena.allow_token_moves()
    assert not ensure(arena.boundary, 2, 1)
    assert arena.take_token_moves() == {}
    assert ensure(arena.boundary, 1, 1)
    assert arena.take_token_moves() == {10: 3, 11: 4}
    check_invariants(arena)


def test_moves_in_one_step_compose_into_one_mapping():
    moves = TokenMoves()
    moves.record(10, 3)
    moves.record(3, 7)  # the same block again: known to the workers as 10
    moves.record(4, 10)  # another block into the id the first one left
    assert moves.take() == {10: 7, 4: 10}
    moves.record(7, 5)
    moves.record(5, 7)  # and back: nothing for the workers
    assert moves.take() == {}
    assert moves.blocks == 5


def test_new_block_ids_to_zero_follow_their_blocks():
    managers = [SimpleNamespace(new_block_ids=[10, 3, 11]), SimpleNamespace()]
    managers[1].new_block_ids = []
    rename = new_block_ids_follow(managers)
    rename(10, 4)
    rename(11, 10)
    assert managers[0].new_block_ids == [4, 3, 10]


def test_the_option_turns_moves_off():
    def options(hybrid_kv: dict) -> HybridKVOptions:
        config = SimpleNamespace(additional_config={"hybrid_kv": hybrid_kv})
        return HybridKVOptions.from_vllm_config(config)

    assert options({}).token_moves
    assert not options({"token_moves": False}).token_moves
    for on in (True, False):
        arena = make_arena()
        coordinator = SimpleNamespace(arena=arena, single_type_managers=())
        scheduler = SimpleNamespace(
            kv_cache_manager=SimpleNamespace(coordinator=coordinator),
            kv_cache_config=SimpleNamespace(token_moves=on),
            connector=None,
        )
        PooledSchedulerMixin._allow_token_moves(scheduler)
        assert (arena.boundary.moves is not None) is on


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(1, 4)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("state"), st.integers(1, 2)),
        st.tuples(st.just("state"), st.integers(1, 2)),
        st.tuples(st.just("release"), st.integers(0, 7)),
    ),
    max_size=40,
)


@given(_OPS)
def test_a_worker_applying_the_moves_keeps_the_schedulers_block_ids(ops):
    """Requests take and free token blocks, the state pool grows and
    shrinks; after every step a worker's copy of each request's block ids,
    renamed by the step's moves at once, equals the scheduler's, and each
    block's bytes (its tag) are where its id says."""
    arena = make_arena()
    arena.allow_token_moves()
    token, state = arena.token_pool, arena.state_pool
    requests: list[list] = []  # the scheduler's blocks per request
    worker: list[list[int]] = []  # the worker's ids per request
    memory: dict[int, object] = {}  # token id -> tag of the bytes there
    content: dict[int, object] = {}  # block -> tag of the bytes it holds
    states: list = state.get_new_blocks(5)  # the state pool starts full
    ops = [("take", 3)] * 3 + ops  # and so does the token pool
    for op, n in ops:
        if op == "take" and ensure(arena.boundary, n, 0):
            blocks = token.get_new_blocks(n)
            requests.append(blocks)
            worker.append(None)  # new this step: ids come with the step
            for block in blocks:
                content[id(block)] = memory[block.block_id] = object()
        elif op == "free" and requests:
            blocks = requests.pop(n % len(requests))
            worker.pop(n % (len(worker)))
            token.free_blocks(blocks)
        elif op == "state" and ensure(arena.boundary, 0, n):
            states.extend(state.get_new_blocks(n))
        elif op == "release" and states:
            state.free_blocks([states.pop(n % len(states))])
        # the step's output reaches the worker
        moves = arena.take_token_moves()
        memory.update({new: memory[old] for old, new in moves.items()})
        for i, blocks in enumerate(requests):
            if worker[i] is None:
                worker[i] = [b.block_id for b in blocks]
            else:
                worker[i] = [moves.get(b, b) for b in worker[i]]
            assert worker[i] == [b.block_id for b in blocks]
            for block in blocks:
                assert content[id(block)] is memory[block.block_id]
                assert block.block_id in token.owned_ids
        check_invariants(arena)
