"""Every capacity figure of a KV cache plan, pooled or upstream's single
shared pool, computed once so that the engine, the CUDA-graph sizing and
``vllm-hybrid plan`` cannot disagree (in ``pooled/``: the lowest package all
its readers may import).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

from vllm_hybrid.v1.core.pooled.boundary import max_token_blocks, plan_arena_layout
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_hybrid.v1.core.pooled.spec import ArenaLayout


def max_state_blocks_per_request(spec: MambaSpec) -> int:
    """State blocks one running request can hold at once (the count of
    upstream's ``MambaSpec.max_memory_usage_bytes``; align mode adds the
    previous state, freed a step later)."""
    if spec.mamba_cache_mode == "align":
        return 2 + spec.num_speculative_blocks + spec.num_prefill_checkpoint_blocks
    return 1 + spec.num_speculative_blocks


def min_state_blocks_per_request(spec: MambaSpec) -> int:
    """State blocks a lone request can run on (the state pool's floor): in
    align mode a request short of memory crosses an edge in the block it
    owns, so the copy target is not needed."""
    if spec.mamba_cache_mode == "align" and spec.num_speculative_blocks == 0:
        return 1 + spec.num_prefill_checkpoint_blocks
    return max_state_blocks_per_request(spec)


@dataclass(frozen=True)
class RequestBytes:
    """Bytes one request of a given length holds in the arena."""

    attention_bytes: int
    state_bytes: int

    @property
    def total(self) -> int:
        return self.attention_bytes + self.state_bytes


def request_bytes(
    num_tokens: int,
    block_size: int,
    token_block_bytes: int,
    state_block_bytes: int,
    state_blocks: int,
) -> RequestBytes:
    """Attention blocks for ``num_tokens`` tokens and ``state_blocks`` state
    blocks."""
    return RequestBytes(
        attention_bytes=cdiv(num_tokens, block_size) * token_block_bytes,
        state_bytes=state_blocks * state_block_bytes,
    )


def token_capacity(layout: ArenaLayout, block_size: int) -> int:
    """Tokens one request can hold: the token pool, the state pool at its
    floor."""
    return max_token_blocks(layout) * block_size


def max_model_len_that_fits(
    arena: int, overlap: bool, tb: int, sb: int, block_size: int, per_req: int
) -> int:
    """Longest sequence one request can hold in ``arena`` bytes (exact)."""
    layout = plan_arena_layout(arena, tb, sb, per_req, overlap, per_req)
    return 0 if layout is None else token_capacity(layout, block_size)


@dataclass(frozen=True)
class PooledCapacity:
    """Capacity figures of a pooled plan, as logged and printed."""

    #: Tokens the token pool can hold for one request (after its state).
    token_capacity: int
    #: Requests of ``max_model_len`` tokens that fit at once.
    max_concurrency: float
    #: Token blocks one request can use (the state pool at its floor).
    max_token_blocks: int
    #: Bytes one request of ``max_model_len`` tokens holds at most.
    bytes_per_request: int
    #: Bytes no block may use (the null blocks).
    null_region_bytes: int


def pooled_capacity(config: PooledKVCacheConfig, max_model_len: int) -> PooledCapacity:
    """:class:`PooledCapacity` for requests of ``max_model_len`` tokens."""
    token = config.pool_by_kind(PoolKind.TOKEN)
    state = config.pool_by_kind(PoolKind.STATE)
    block_size = config.kv_cache_groups[token.group_ids[0]].kv_cache_spec.block_size
    layout = config.layout
    blocks = max_token_blocks(layout)
    usable = layout.arena_bytes - layout.null_region_bytes
    per_request = request_bytes(
        max_model_len,
        block_size,
        token.block_bytes,
        state.block_bytes,
        config.max_state_blocks_per_request,
    ).total
    return PooledCapacity(
        token_capacity=token_capacity(layout, block_size),
        max_concurrency=usable / per_request,
        max_token_blocks=blocks,
        bytes_per_request=per_request,
        null_region_bytes=layout.null_region_bytes,
    )


@dataclass(frozen=True)
class StateRoom:
    """State blocks a KV cache can give running requests at once."""

    #: State blocks the engine can give running requests at once.
    state_blocks: int
    #: State blocks one running request holds at least.
    blocks_per_request: int
    #: Bytes of a state block and of the whole KV cache; None where the
    #: config carries no tensors to measure.
    state_block_bytes: int | None
    arena_bytes: int | None
    #: What holds the states: "arena" (pooled) or "shared pool".
    holder: str = "arena"

    @property
    def max_states(self) -> int:
        """Requests whose states the KV cache can hold at once."""
        return self.state_blocks // self.blocks_per_request

    def bytes_for(self, requests: int) -> int | None:
        """KV cache bytes that hold ``requests`` requests' states (None:
        sizes unknown)."""
        if self.arena_bytes is None or self.state_block_bytes is None:
            return None
        missing = requests * self.blocks_per_request - self.state_blocks
        return self.arena_bytes + max(0, missing) * self.state_block_bytes


def pooled_state_room(config: PooledKVCacheConfig) -> StateRoom:
    """The state pool at its highest extent, each running request holding
    its lone-request minimum."""
    state = config.pool_by_kind(PoolKind.STATE)
    spec = config.kv_cache_groups[state.group_ids[0]].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    layout = config.layout
    return StateRoom(
        state_blocks=layout.state_capacity_at(layout.min_state_floor),
        blocks_per_request=min_state_blocks_per_request(spec),
        state_block_bytes=state.block_bytes,
        arena_bytes=layout.arena_bytes,
    )


def shared_pool_state_room(config: KVCacheConfig) -> StateRoom:
    """Upstream's shared pool: ``num_blocks`` state blocks, one per running
    request at least."""
    sizes = [t.size for t in getattr(config, "kv_cache_tensors", None) or ()]
    size = max(sizes) if sizes else None
    return StateRoom(
        state_blocks=config.num_blocks,
        blocks_per_request=1,
        state_block_bytes=None if size is None else _per_block(size, config),
        arena_bytes=size,
        holder="shared pool",
    )


def _per_block(size: int, config: KVCacheConfig) -> int:
    return size // max(1, config.num_blocks)


def shared_block_bytes(config: KVCacheConfig) -> int:
    """Bytes one block id of upstream's shared pool stands for: its groups
    overlay one backing allocation, an id belonging to one at a time."""
    sizes = {tensor.size for tensor in config.kv_cache_tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"expected one backing allocation for the KV cache, got sizes {sizes}"
        )
    return _per_block(sizes.pop(), config)


def group_blocks_per_request(
    vllm_config: VllmConfig, groups: Iterable[KVCacheGroupSpec]
) -> int:
    """Blocks one running request of ``max_model_len`` tokens holds at most
    in ``groups`` of the single shared pool, counted as upstream's
    concurrency counts them."""
    return sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(vllm_config),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in groups
    )


def _max_tokens_within(num_blocks: int, blocks_for: Callable[[int], int]) -> int:
    """The largest ``t`` with ``blocks_for(t) <= num_blocks``
    (``blocks_for`` non-decreasing, zero at zero and unbounded)."""
    if num_blocks <= 0:
        return 0
    high = 1
    while blocks_for(high) <= num_blocks:
        high *= 2
        if high > num_blocks << 40:
            raise ValueError("token groups must need more blocks for more tokens")
    low = high // 2  # fits (0 when high == 1)
    while high - low > 1:
        mid = (low + high) // 2
        if blocks_for(mid) <= num_blocks:
            low = mid
        else:
            high = mid
    return low


def shared_pool_token_capacity(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    split: tuple[list[KVCacheGroupSpec], list[KVCacheGroupSpec]],
) -> int:
    """Tokens one request can hold in the shared pool of a hybrid model:
    the largest ``t`` with ``sum(cdiv(t, b_g) for token groups) <=
    num_blocks - 1 - state`` (a lower bound for sliding-window groups).
    ``split`` is ``(token groups, other groups)``."""
    token_groups, others = split
    state = group_blocks_per_request(vllm_config, others)
    free = kv_cache_config.num_blocks - 1 - state

    def blocks_for(num_tokens: int) -> int:
        return sum(
            g.kv_cache_spec.max_num_blocks_per_req(vllm_config, num_tokens)
            for g in token_groups
        )

    return _max_tokens_within(free, blocks_for)
