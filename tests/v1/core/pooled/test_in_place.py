"""When a running request may advance its state in the block it owns.

Short of state blocks, the pooled coordinator lets a running request cross a
state block edge in place instead of taking a fresh block (see
``Admitter._in_place_blocks``). That is safe only while no one
else reads the block. With async scheduling the slot the request advanced
from at its previous crossing still names the same block until upstream
retires it two steps later, so the block has two references, both the
request's own. Refusing then made a long prefill preempt itself at every
other chunk: on the simulator's Qwen3.6-35B-A3B-FP8 at 48 GB bf16 (first 300
Mooncake requests) that was 43 preemptions instead of 24.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_hybrid.v1.core.pooled.admission import Admission, Admitter, Way
from vllm_hybrid.v1.core.pooled.boundary import BoundaryPlan
from vllm_hybrid.v1.core.pooled.coordinator import PooledCoordinatorMixin
from vllm_hybrid.v1.core.pooled.spec import PoolKind

NULL = KVCacheBlock(block_id=0)
NULL.is_null = True


def _block(block_id: int, ref_cnt: int) -> KVCacheBlock:
    block = KVCacheBlock(block_id=block_id)
    block.ref_cnt = ref_cnt
    return block


def _admitter(blocks: list[KVCacheBlock], retiring: int | None) -> SimpleNamespace:
    """One attention and one state group; request "r" owns ``blocks`` in the
    state group, ``retiring`` is the slot upstream retires next."""
    state = SimpleNamespace(
        mamba_cache_mode="align",
        num_speculative_blocks=0,
        _allocated_block_reqs={"r"},
        req_to_blocks={"r": blocks},
        last_state_block_idx={} if retiring is None else {"r": retiring},
    )
    return SimpleNamespace(
        managers=(SimpleNamespace(), state),
        kinds=(PoolKind.TOKEN, PoolKind.STATE),
        _state_groups=(1,),
    )


def _in_place(admitter: SimpleNamespace, needs: list[int]) -> dict:
    return Admitter._in_place_blocks(admitter, "r", needs)


def test_a_lone_running_block_advances_in_place() -> None:
    running = _block(7, ref_cnt=1)
    found = _in_place(_admitter([NULL, NULL, running], retiring=None), [3, 1])
    assert found == {1: running}


def test_the_slot_awaiting_retirement_is_the_requests_own_reference() -> None:
    # advanced in place one step ago: slots 1 and 4 both name block 7
    running = _block(7, ref_cnt=2)
    blocks = [NULL, running, NULL, NULL, running]
    assert _in_place(_admitter(blocks, retiring=1), [8, 1]) == {1: running}


def test_a_block_another_request_holds_is_not_advanced() -> None:
    # a prefix hit shared with another request: one reference is not ours
    shared = _block(7, ref_cnt=2)
    older = _block(9, ref_cnt=1)
    assert _in_place(_admitter([NULL, older, shared], retiring=1), [1, 1]) == {}
    assert _in_place(_admitter([NULL, NULL, shared], retiring=None), [1, 1]) == {}
    # both slots ours and a third reader
    read = _block(7, ref_cnt=3)
    assert _in_place(_admitter([NULL, read, NULL, read], retiring=1), [1, 1]) == {}


def test_only_a_one_block_edge_advances_in_place() -> None:
    running = _block(7, ref_cnt=1)
    assert _in_place(_admitter([NULL, running], retiring=None), [1, 2]) == {}
    assert _in_place(_admitter([NULL, running], retiring=None), [1, 0]) == {}


class _Manager:
    """Allocates as align mode does at a state block edge: one block from
    whatever ``block_pool`` it is pointed at."""

    def __init__(self, pool: object) -> None:
        self.block_pool = pool

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return self.block_pool.get_new_blocks(1)


class _Pool:
    def __init__(self, fresh: KVCacheBlock) -> None:
        self.fresh = fresh

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        return [self.fresh]

    def advance_in_place(self, block: KVCacheBlock) -> list[KVCacheBlock]:
        return [block]


def test_the_allocation_carries_out_what_admission_decided() -> None:
    """The running block of the admission travels down to the state group's
    manager as a value; the token group and the pools keep no note of it,
    and the way it was served is counted."""
    running, fresh_token = _block(7, ref_cnt=1), _block(3, ref_cnt=0)
    token_pool, state_pool = _Pool(fresh_token), _Pool(_block(9, ref_cnt=0))
    carried = []
    coordinator = SimpleNamespace(
        single_type_managers=(_Manager(token_pool), _Manager(state_pool)),
        arena=SimpleNamespace(boundary=SimpleNamespace(carry_out=carried.append)),
        short_memory_counts={"state_in_place": 0, "edges_in_place": 0},
    )
    plan = BoundaryPlan(target=5)
    admission = Admission(1, 0, plan, {1: running}, Way.EDGE_IN_PLACE)
    out = PooledCoordinatorMixin.allocate(coordinator, admission, "r", 16, 16)
    assert out == ([fresh_token], [running])
    assert carried == [plan]
    assert coordinator.short_memory_counts["edges_in_place"] == 1
    managers = coordinator.single_type_managers
    assert (managers[0].block_pool, managers[1].block_pool) == (token_pool, state_pool)
