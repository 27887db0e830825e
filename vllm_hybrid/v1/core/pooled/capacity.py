"""Capacity of a KV cache plan: the one module that computes its figures.

Every reader of a capacity figure takes it from here: the pooled planner
(its too-small message and ``--max-model-len -1``), the engine's log line and
``cache_config`` (pooled and single shared pool alike), the CUDA-graph sizing
(how many requests' states the KV cache holds) and ``vllm-hybrid plan``. A
change to what a capacity means is therefore made once, and the engine, the
graphs and the planner tool cannot disagree about it.

Both plan kinds are here, pooled mode's arena and upstream's single shared
pool of a hybrid model, because the CUDA-graph sizing and the planner tool
set them side by side. The module sits in ``pooled/`` because that is the
lowest package all those readers may import: the planner is inside pooled
mode, and the others are above it. It is arithmetic only: the arena's
geometry comes from :mod:`~vllm_hybrid.v1.core.pooled.spec` and
:mod:`~vllm_hybrid.v1.core.pooled.boundary`, the choice of which groups of a
shared pool grow with the sequence from
:mod:`vllm_hybrid.v1.core.token_capacity`.
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

# ---------------------------------------------------------------------------
# Pooled mode: one request, the arena
# ---------------------------------------------------------------------------


def max_state_blocks_per_request(spec: MambaSpec) -> int:
    """State blocks one running request can hold at once.

    ``none`` mode: one live state (plus speculative slots). ``align`` mode:
    the running state, the previous one (freed a step later), speculative
    slots and a prefill checkpoint where the layer type has one; upstream's
    ``MambaSpec.max_memory_usage_bytes`` encodes the same count.
    """
    if spec.mamba_cache_mode == "align":
        return 2 + spec.num_speculative_blocks + spec.num_prefill_checkpoint_blocks
    return 1 + spec.num_speculative_blocks


def min_state_blocks_per_request(spec: MambaSpec) -> int:
    """State blocks a lone request can run on.

    In align mode the pooled coordinator lets a running request cross a
    state block edge in the block it owns when the arena is short (see
    ``PooledCoordinatorMixin._in_place_blocks``), so the copy target is not
    needed; prefill checkpoints and speculative slots still are. This is the
    floor of the state pool, what the longest single request is computed
    with and what a full CUDA graph's row needs; concurrency figures keep
    :func:`max_state_blocks_per_request`.
    """
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
    blocks: what the too-small message and the concurrency both count."""
    return RequestBytes(
        attention_bytes=cdiv(num_tokens, block_size) * token_block_bytes,
        state_bytes=state_blocks * state_block_bytes,
    )


def token_capacity(layout: ArenaLayout, block_size: int) -> int:
    """Tokens one request can hold in ``layout``: the token pool with the
    state pool at its floor."""
    return max_token_blocks(layout) * block_size


def max_model_len_that_fits(
    arena: int, overlap: bool, tb: int, sb: int, block_size: int, per_req: int
) -> int:
    """Longest sequence one request can hold in ``arena`` bytes (exact: block
    ids and the state-block-aligned boundary included)."""
    layout = plan_arena_layout(arena, tb, sb, per_req, overlap, per_req)
    return 0 if layout is None else token_capacity(layout, block_size)


@dataclass(frozen=True)
class PooledCapacity:
    """Capacity figures of a pooled plan: what the engine logs and stores in
    its cache config, and what ``vllm-hybrid plan`` prints."""

    #: Tokens the token pool can hold for one request (state of one request
    #: and the null blocks taken out).
    token_capacity: int
    #: Requests of ``max_model_len`` tokens that fit at once.
    max_concurrency: float
    #: Token blocks one request can use (the state pool at its floor).
    max_token_blocks: int
    #: Bytes one request of ``max_model_len`` tokens holds at most: its
    #: attention blocks and ``max_state_blocks_per_request`` state blocks.
    bytes_per_request: int
    #: Bytes no block may use (the null blocks).
    null_region_bytes: int


def pooled_capacity(config: PooledKVCacheConfig, max_model_len: int) -> PooledCapacity:
    """The capacity figures of a pooled plan for requests of
    ``max_model_len`` tokens."""
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


# ---------------------------------------------------------------------------
# States the KV cache holds at once (what a full CUDA graph's rows need)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StateRoom:
    """State blocks a KV cache can give running requests at once."""

    #: State blocks the engine can give running requests at once.
    state_blocks: int
    #: State blocks one running request holds at least.
    blocks_per_request: int
    #: Bytes of a state block and of the whole KV cache; None where the
    #: config carries no tensors to measure (messages then leave the byte
    #: figures out).
    state_block_bytes: int | None
    arena_bytes: int | None
    #: What holds the states: "arena" (pooled) or "shared pool".
    holder: str = "arena"

    @property
    def max_states(self) -> int:
        """Requests whose states the KV cache can hold at once."""
        return self.state_blocks // self.blocks_per_request

    def bytes_for(self, requests: int) -> int | None:
        """KV cache that holds ``requests`` requests' states (None: sizes
        unknown).

        Exact for the arena: whole state blocks added to it add as many ids
        to the state pool and leave the null region and the token pool's
        minimum (hence the lowest state floor) where they are.
        """
        if self.arena_bytes is None or self.state_block_bytes is None:
            return None
        missing = requests * self.blocks_per_request - self.state_blocks
        return self.arena_bytes + max(0, missing) * self.state_block_bytes


def pooled_state_room(config: PooledKVCacheConfig) -> StateRoom:
    """The state pool at its highest extent (the token pool at its floor),
    each running request holding its lone-request minimum."""
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
    """Upstream's shared pool: every state layer's view has ``num_blocks``
    blocks, and each running request holds at least one of them.

    Reads only ``num_blocks`` for the count; the tensor sizes, when
    ``config`` has them, only add the byte figures, so a config without them
    (a test's stand-in, a plugin's profiling call) gets the same room."""
    sizes = [t.size for t in getattr(config, "kv_cache_tensors", None) or ()]
    size = max(sizes) if sizes else None
    return StateRoom(
        state_blocks=config.num_blocks,
        blocks_per_request=1,
        state_block_bytes=None if size is None else _per_block(size, config),
        arena_bytes=size,
        holder="shared pool",
    )


# ---------------------------------------------------------------------------
# Upstream's single shared pool of a hybrid model
# ---------------------------------------------------------------------------


def _per_block(size: int, config: KVCacheConfig) -> int:
    return size // max(1, config.num_blocks)


def shared_block_bytes(config: KVCacheConfig) -> int:
    """Bytes one block id of upstream's shared pool stands for.

    Every ``KVCacheTensor`` of a config places its layers in the same backing
    allocation (vLLM's ``allocate_kv_cache`` allocates that buffer once):
    the state groups of a hybrid overlay the attention group's bytes, and a
    block id belongs to one group at a time. So the buffer, counted once,
    divided by the block count is the price of one id, whichever group holds
    it. Raises ValueError for a config of several allocations.
    """
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
    in ``groups`` of the single shared pool.

    The per-group count upstream's concurrency uses as well:
    ``cdiv(max_memory_usage_bytes, page_size_bytes)``, i.e. ``1 + num_spec``
    per Mamba group in "none" mode, ``2 + num_spec + checkpoints`` in "align".
    """
    return sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(vllm_config),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in groups
    )


def _max_tokens_within(num_blocks: int, blocks_for: Callable[[int], int]) -> int:
    """The largest token count ``t`` with ``blocks_for(t) <= num_blocks``.

    ``blocks_for`` must be non-decreasing, zero at zero and unbounded, which
    holds for token groups: each needs at least ``cdiv(t, block span)``.
    """
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
    """Tokens one request can hold in the shared pool of a hybrid model.

    All groups draw block ids from one pool of ``num_blocks`` blocks, of which
    block 0 is the null block. A request holding ``t`` tokens needs
    ``spec.max_num_blocks_per_req(t)`` blocks (``cdiv(t, block_size * dcp)``)
    in every token group, plus the state blocks of every other group
    (:func:`group_blocks_per_request`). The capacity is the largest ``t``
    that fits::

        sum(cdiv(t, b_g) for g in token_groups) <= num_blocks - 1 - state

    which for token groups of one block size ``b`` is
    ``(num_blocks - 1 - state) // len(token_groups) * b``. Sliding-window
    groups are counted as if they kept every token, so for them this is a
    lower bound. Each further concurrent request costs another ``state``
    blocks, which the maximum concurrency (all groups) accounts for.

    ``split`` is ``(token groups, other groups)``, as
    :func:`vllm_hybrid.v1.core.token_capacity.split_token_groups` answers.
    """
    token_groups, others = split
    state = group_blocks_per_request(vllm_config, others)
    free = kv_cache_config.num_blocks - 1 - state

    def blocks_for(num_tokens: int) -> int:
        return sum(
            g.kv_cache_spec.max_num_blocks_per_req(vllm_config, num_tokens)
            for g in token_groups
        )

    return _max_tokens_within(free, blocks_for)
