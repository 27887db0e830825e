"""Which groups of the single shared pool of a hybrid model count as tokens.

Upstream derives "KV cache size: N tokens" from a concurrency in which
constant-size state groups (Mamba, GDN, short conv) weigh like attention, so
the figure does not say how many tokens fit. Here only the groups whose
memory grows with the sequence count as tokens; the state groups' blocks per
request are taken out first. This module sorts the groups; the arithmetic on
them is in :mod:`vllm_hybrid.v1.core.pooled.capacity`, with every other
capacity figure. The upstream entry points that use both are in
:mod:`vllm_hybrid.v1.core.kv_cache_utils`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
