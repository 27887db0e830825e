"""Turn-end retention's bookkeeping without an engine: which earlier decode
checkpoint is evicted when a later one is cached (retention.py), and which
configs get the retaining coordinator at all."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from vllm_hybrid.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm_hybrid.v1.core.pooled.policy.positions import CheckpointPolicy
from vllm_hybrid.v1.core.pooled.retention import TurnEndRetentionMixin
from vllm_hybrid.v1.core.turn_ends import (
    RETAIN_ATTRIBUTE,
    has_align_state_groups,
    mark_turn_end_retention,
)

BLOCK = 32


@dataclass
class FakeBlock:
    block_id: int
    block_hash: object = None
    ref_cnt: int = 0
    is_null: bool = False


@dataclass
class FakeQueue:
    """A free queue as a list, LRU head first."""

    order: list[int] = field(default_factory=list)

    def remove(self, block) -> None:
        self.order.remove(block.block_id)

    def prepend_n(self, blocks) -> None:
        self.order[:0] = [b.block_id for b in blocks]


@dataclass
class FakePool:
    evicted: list[int] = field(default_factory=list)
    free_block_queue: FakeQueue = field(default_factory=FakeQueue)

    def evict_blocks(self, ids: set[int]) -> None:
        self.evicted += sorted(ids)


@dataclass
class FakeManager:
    block_size: int = BLOCK
    block_pool: FakePool = field(default_factory=FakePool)
    req_to_blocks: dict[str, list[FakeBlock]] = field(default_factory=dict)


class Upstream:
    """What the mixin calls through super(): freeing returns nothing here;
    tests put blocks in the fake queue themselves."""

    def free(self, request_id: str) -> None:
        pass

    def remove_skipped_blocks(self, request_id: str, *args) -> None:
        pass


class Coordinator(TurnEndRetentionMixin, Upstream):
    def __init__(self, interval: int | None, manager=None) -> None:
        self.retention_interval = interval
        self.single_type_managers = (manager,)
        self._init_turn_ends(CheckpointPolicy.of(True))


def _decode(coord: Coordinator, manager: FakeManager, blocks: int) -> None:
    """A request fills ``blocks`` blocks one by one; each gets cached."""
    owned = manager.req_to_blocks.setdefault("r", [])
    for i in range(blocks):
        owned.append(FakeBlock(i, block_hash=("key", i)))
        coord._supersede(0, manager, "r", (i + 1) * BLOCK + 5, prompt_len=0)


def test_each_later_checkpoint_evicts_the_previous_one():
    coord, manager = Coordinator(interval=0), FakeManager()
    _decode(coord, manager, 4)
    assert manager.block_pool.evicted == [0, 1, 2]
    counts = coord.turn_end_counts
    assert (counts.cached, counts.superseded, counts.kept) == (4, 3, 0)
    assert counts.by_request["r"][0].num_tokens == 4 * BLOCK


def test_the_retention_interval_keeps_its_edges():
    coord, manager = Coordinator(interval=2 * BLOCK), FakeManager()
    _decode(coord, manager, 4)
    # edges 64 and 128 are periodic checkpoints; 32 and 96 are superseded
    assert manager.block_pool.evicted == [0, 2]
    assert coord.turn_end_counts.kept == 1  # 64 (128 is still the latest)


def test_a_checkpoint_another_request_uses_is_kept():
    coord, manager = Coordinator(interval=0), FakeManager()
    _decode(coord, manager, 1)
    manager.req_to_blocks["r"][0].ref_cnt = 1  # a hit by another request
    manager.req_to_blocks["r"].append(FakeBlock(1, block_hash=("key", 1)))
    coord._supersede(0, manager, "r", 2 * BLOCK, prompt_len=0)
    assert manager.block_pool.evicted == []
    assert coord.turn_end_counts.kept == 1


def test_a_reused_block_is_not_evicted_for_its_old_key():
    coord, manager = Coordinator(interval=0), FakeManager()
    _decode(coord, manager, 1)
    manager.req_to_blocks["r"][0].block_hash = ("someone else's key",)
    manager.req_to_blocks["r"].append(FakeBlock(1, block_hash=("key", 1)))
    coord._supersede(0, manager, "r", 2 * BLOCK, prompt_len=0)
    assert manager.block_pool.evicted == []


@pytest.mark.parametrize("position", [BLOCK - 1, 2 * BLOCK + 1])
def test_positions_without_a_cached_block_record_nothing(position):
    coord, manager = Coordinator(interval=0), FakeManager()
    manager.req_to_blocks["r"] = [FakeBlock(0), FakeBlock(1)]  # no hashes
    coord._supersede(0, manager, "r", position, prompt_len=0)
    assert coord.turn_end_counts.cached == 0


def test_the_prompts_own_checkpoint_is_never_superseded():
    """A 100-token prompt: its last full block (edge 96) is the prompt's
    checkpoint. The first output tokens (positions 101..128) still see edge
    96; the first decode edge is 128. Crossing 160 evicts 128, never 96."""
    coord, manager = Coordinator(interval=0), FakeManager()
    manager.req_to_blocks["r"] = [FakeBlock(i, block_hash=("key", i)) for i in range(5)]
    for position in range(101, 5 * BLOCK + 1):
        coord._supersede(0, manager, "r", position, prompt_len=100)
    assert manager.block_pool.evicted == [3]  # edge 128, not 2 (edge 96)
    counts = coord.turn_end_counts
    assert (counts.cached, counts.superseded) == (2, 1)
    assert counts.by_request["r"][0].num_tokens == 5 * BLOCK


def test_a_prompt_ending_on_an_edge_keeps_its_checkpoint():
    coord, manager = Coordinator(interval=0), FakeManager()
    manager.req_to_blocks["r"] = [FakeBlock(i, block_hash=("key", i)) for i in range(3)]
    for position in range(2 * BLOCK + 1, 3 * BLOCK + 1):
        coord._supersede(0, manager, "r", position, prompt_len=2 * BLOCK)
    assert manager.block_pool.evicted == []
    assert coord.turn_end_counts.cached == 1


def test_a_freed_decode_checkpoint_is_evicted_first():
    """Retired while its request runs, or freed with it: either way the
    decode checkpoint goes to the head of the LRU queue (evicted before the
    prompt checkpoints freed before it), once."""
    manager = FakeManager()
    coord = Coordinator(interval=0, manager=manager)
    manager.req_to_blocks["r"] = [FakeBlock(i, block_hash=("k", i)) for i in range(4)]
    queue = manager.block_pool.free_block_queue
    queue.order = [7, 8]  # older cached blocks, e.g. prompt checkpoints
    coord._supersede(0, manager, "r", 3 * BLOCK + 1, prompt_len=2 * BLOCK)
    held = manager.req_to_blocks["r"][2]  # edge 96, the decode checkpoint
    held.ref_cnt = 1
    coord.remove_skipped_blocks("r", 3 * BLOCK)
    assert queue.order == [7, 8]  # still held by the request
    held.ref_cnt = 0
    queue.order.append(held.block_id)  # retired: upstream appends at the tail
    coord.remove_skipped_blocks("r", 3 * BLOCK + 5)
    assert queue.order == [2, 7, 8]
    coord.free("r")  # already ranked: not moved again
    assert queue.order == [2, 7, 8]
    assert coord.turn_end_counts.ranked_first == 1


def test_a_checkpoint_that_changed_is_not_ranked():
    manager = FakeManager()
    coord = Coordinator(interval=0, manager=manager)
    manager.req_to_blocks["r"] = [FakeBlock(i, block_hash=("k", i)) for i in range(2)]
    coord._supersede(0, manager, "r", 2 * BLOCK, prompt_len=BLOCK)
    manager.req_to_blocks["r"][1].block_hash = ("reused elsewhere",)
    manager.block_pool.free_block_queue.order = [1, 5]
    coord.free("r")
    assert manager.block_pool.free_block_queue.order == [1, 5]
    assert coord.turn_end_counts.ranked_first == 0


# -- which configs keep turn ends


def _hybrid_config(mode: str, attention: bool = True) -> KVCacheConfig:
    """32 blocks of 16 tokens: one attention group (unless left out) and one
    state group in ``mode``."""
    attn = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    state = MambaSpec(
        block_size=16,
        shapes=((64,),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
    )
    groups = [KVCacheGroupSpec(["attn"], attn)] if attention else []
    groups.append(KVCacheGroupSpec(["state"], state))
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize(
    ("mode", "attention", "retained", "coordinator"),
    [
        ("align", True, True, "TurnEndHybridKVCacheCoordinator"),
        ("all", True, False, "HybridKVCacheCoordinator"),
        ("none", True, False, "HybridKVCacheCoordinator"),
        ("align", False, False, "UnitaryKVCacheCoordinator"),
    ],
)
def test_only_align_mode_state_groups_beside_attention_keep_turn_ends(
    mode, attention, retained, coordinator
):
    """Only a state group in align mode leaves decode checkpoints behind:
    a state kept at every edge (``all``), none kept (``none``) or a model of
    state layers alone get upstream's coordinator, untouched."""
    config = _hybrid_config(mode, attention)
    assert has_align_state_groups(config) is retained
    mark_turn_end_retention(config, True)
    assert getattr(config, RETAIN_ATTRIBUTE, None) is (True if retained else None)
    # max_model_len 256, 256 tokens in flight, no EAGLE, caching on, no
    # events, one DCP/PCP rank, 16-token scheduler and hash blocks
    built = get_kv_cache_coordinator(config, 256, 256, False, True, False, 1, 1, 16, 16)
    assert type(built).__name__ == coordinator
    assert len(built.single_type_managers) == (2 if attention else 1)
    assert built.block_pool.num_gpu_blocks == 32


def test_the_option_off_gives_upstreams_coordinator_in_align_mode():
    config = _hybrid_config("align")
    mark_turn_end_retention(config, False)
    assert getattr(config, RETAIN_ATTRIBUTE) is False
    built = get_kv_cache_coordinator(config, 256, 256, False, True, False, 1, 1, 16, 16)
    assert type(built).__name__ == "HybridKVCacheCoordinator"
