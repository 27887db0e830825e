"""Honest token capacity of the single shared pool of a hybrid model.

Upstream derives "KV cache size: N tokens" from a concurrency in which
constant-size state groups (Mamba, GDN, short conv) weigh like attention, so
the figure does not say how many tokens fit. Here only the groups whose
memory grows with the sequence count as tokens; the state groups' blocks per
request are taken out first. The upstream entry points that use this are in
:mod:`vllm_hybrid.v1.core.kv_cache_utils`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


#: Specs whose memory grows with the sequence length (MLA and hidden-state
#: caches are FullAttentionSpec subclasses, sliding-window MLA a
#: SlidingWindowSpec). Mamba/GDN/short-conv state, cross-attention (encoder
#: length), encoder-only, ring buffers and HiSparse scratch are per request.
_TOKEN_SPEC_TYPES: tuple[type[KVCacheSpec], ...] = (
    FullAttentionSpec,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
)


def is_token_capacity_spec(spec: KVCacheSpec) -> bool:
    """Whether a group with this spec needs memory per token of the sequence."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        if not spec.kv_cache_specs:
            return False
        spec = spec.first_spec
    return isinstance(spec, _TOKEN_SPEC_TYPES)


def token_capacity_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> list[KVCacheGroupSpec]:
    """The groups whose memory grows with sequence length.

    Full, sliding-window, chunked-local and MLA attention count; Mamba, GDN
    and short-conv state and other constant-size caches do not. When no group
    qualifies (attention-free models) every group is returned, so token
    capacity stays defined. ``vllm_config`` is taken for parity with
    upstream's capacity helpers; 0.32 has no cache mode in which a state
    group grows with the sequence.
    """
    del vllm_config
    groups = list(kv_cache_config.kv_cache_groups)
    token_groups = [g for g in groups if is_token_capacity_spec(g.kv_cache_spec)]
    return token_groups or groups


def split_token_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[list[KVCacheGroupSpec], list[KVCacheGroupSpec]] | None:
    """``(token groups, other groups)`` when the hybrid formula applies.

    None when every group is a token group (dense and attention-free models)
    or a group lives in the HiSparse host pool: upstream's numbers stand then.
    """
    groups = kv_cache_config.kv_cache_groups
    if any(g.host_resident for g in groups):
        return None
    token_groups = token_capacity_kv_cache_groups(vllm_config, kv_cache_config)
    token_ids = {id(g) for g in token_groups}
    others = [g for g in groups if id(g) not in token_ids]
    if not others:
        return None
    return token_groups, others


def state_group_blocks_per_request(
    vllm_config: VllmConfig, groups: Iterable[KVCacheGroupSpec]
) -> int:
    """Blocks one running request holds at most in ``groups`` (the groups
    that do not grow with the sequence) of the single shared pool.

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
    (:func:`state_group_blocks_per_request`). The capacity is the largest ``t``
    that fits::

        sum(cdiv(t, b_g) for g in token_groups) <= num_blocks - 1 - state

    which for token groups of one block size ``b`` is
    ``(num_blocks - 1 - state) // len(token_groups) * b``. Sliding-window
    groups are counted as if they kept every token, so for them this is a
    lower bound. Each further concurrent request costs another ``state``
    blocks, which the maximum concurrency (all groups) accounts for.

    ``split`` is :func:`split_token_groups`'s answer (not None).
    """
    token_groups, others = split
    free = (
        kv_cache_config.num_blocks
        - 1
        - state_group_blocks_per_request(vllm_config, others)
    )

    def blocks_for(num_tokens: int) -> int:
        return sum(
            g.kv_cache_spec.max_num_blocks_per_req(vllm_config, num_tokens)
            for g in token_groups
        )

    return _max_tokens_within(free, blocks_for)
