"""When a running request may advance its state in the block it owns.

Short of state blocks, the pooled coordinator lets a running request cross a
state block edge in place instead of taking a fresh block (see
``PooledCoordinatorMixin._in_place_blocks``). That is safe only while no one
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

from vllm_hybrid.v1.core.pooled.coordinator import (
    PooledCoordinatorMixin,
    Reservation,
)
from vllm_hybrid.v1.core.pooled.spec import PoolKind

NULL = KVCacheBlock(block_id=0)
NULL.is_null = True


def _block(block_id: int, ref_cnt: int) -> KVCacheBlock:
    block = KVCacheBlock(block_id=block_id)
    block.ref_cnt = ref_cnt
    return block


def _coordinator(blocks: list[KVCacheBlock], retiring: int | None) -> SimpleNamespace:
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
        single_type_managers=(SimpleNamespace(), state),
        _group_kind=[PoolKind.TOKEN, PoolKind.STATE],
    )


def _in_place(coordinator: SimpleNamespace, needs: list[int]) -> dict:
    return PooledCoordinatorMixin._in_place_blocks(coordinator, "r", needs)


def test_a_lone_running_block_advances_in_place() -> None:
    running = _block(7, ref_cnt=1)
    found = _in_place(_coordinator([NULL, NULL, running], retiring=None), [3, 1])
    assert found == {1: running}


def test_the_slot_awaiting_retirement_is_the_requests_own_reference() -> None:
    # advanced in place one step ago: slots 1 and 4 both name block 7
    running = _block(7, ref_cnt=2)
    blocks = [NULL, running, NULL, NULL, running]
    assert _in_place(_coordinator(blocks, retiring=1), [8, 1]) == {1: running}


def test_a_block_another_request_holds_is_not_advanced() -> None:
    # a prefix hit shared with another request: one reference is not ours
    shared = _block(7, ref_cnt=2)
    older = _block(9, ref_cnt=1)
    assert _in_place(_coordinator([NULL, older, shared], retiring=1), [1, 1]) == {}
    assert _in_place(_coordinator([NULL, NULL, shared], retiring=None), [1, 1]) == {}
    # both slots ours and a third reader
    read = _block(7, ref_cnt=3)
    assert _in_place(_coordinator([NULL, read, NULL, read], retiring=1), [1, 1]) == {}


def test_only_a_one_block_edge_advances_in_place() -> None:
    running = _block(7, ref_cnt=1)
    assert _in_place(_coordinator([NULL, running], retiring=None), [1, 2]) == {}
    assert _in_place(_coordinator([NULL, running], retiring=None), [1, 0]) == {}


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


def test_the_allocation_consumes_what_admission_reserved() -> None:
    """A reserved running block travels down to the state group's manager
    as a value; the token group and the pools keep no note of it."""
    running, fresh_token = _block(7, ref_cnt=1), _block(3, ref_cnt=0)
    token_pool, state_pool = _Pool(fresh_token), _Pool(_block(9, ref_cnt=0))
    coordinator = SimpleNamespace(
        single_type_managers=(_Manager(token_pool), _Manager(state_pool)),
        _reserved={
            "r": Reservation(token_blocks=1, state_blocks=0, in_place={1: running})
        },
    )
    out = PooledCoordinatorMixin.allocate_new_blocks(coordinator, "r", 16, 16)
    assert out == ([fresh_token], [running])
    assert coordinator._reserved == {}
    managers = coordinator.single_type_managers
    assert (managers[0].block_pool, managers[1].block_pool) == (token_pool, state_pool)


class _Freeing:
    """What the mixin's ``free`` and ``pop_blocks_for_free`` hand on to."""

    def __init__(self) -> None:
        self.freed: list[str] = []

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.freed.append(request_id)
        return []


class _FreeingCoordinator(PooledCoordinatorMixin, _Freeing):
    def __init__(self, reserved: dict[str, Reservation]) -> None:
        super().__init__()
        self._reserved = reserved


def test_freeing_a_request_drops_a_reservation_no_allocation_came_for() -> None:
    """Upstream may refuse the allocation after admission reserved a running
    block (its watermark); the request may then finish without another
    admission, and its reservation goes with it."""
    running = _block(7, ref_cnt=1)
    reserved = {
        rid: Reservation(token_blocks=0, state_blocks=0, in_place={1: running})
        for rid in ("a", "b", "c")
    }
    coordinator = _FreeingCoordinator(reserved)
    coordinator.free("a")
    assert coordinator.pop_blocks_for_free("b") == []
    assert list(coordinator._reserved) == ["c"]
    assert coordinator.freed == ["a", "b"]
