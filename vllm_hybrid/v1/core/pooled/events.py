"""The prefix-cache events a pool records for the coupling, as values.

A pool appends them to the list the coupling gave it while an operation
runs and calls nothing above it; the coupling (:mod:`.coupling`) handles
them once the operation returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock

from vllm_hybrid.v1.core.pooled.spec import PoolKind


@dataclass(frozen=True, slots=True)
class KeyCached:
    """Pool ``kind`` cached ``key`` for the first ``num_tokens`` tokens of
    the request being cached (a state checkpoint gets linked to its
    attention prefix)."""

    kind: PoolKind
    key: BlockHashWithGroupId
    num_tokens: int


@dataclass(frozen=True, slots=True)
class KeysLeftCache:
    """No block of pool ``kind`` holds ``keys`` any more (what depended on
    them in the other pool may be dead now)."""

    kind: PoolKind
    keys: list[BlockHashWithGroupId]


@dataclass(frozen=True, slots=True)
class BlocksFreed:
    """Pool ``kind`` took a reference off each of ``blocks`` (the free ones
    among them may be dead entries)."""

    kind: PoolKind
    blocks: list[KVCacheBlock]


#: A prefix-cache event a pool records for the coupling.
CacheEvent = KeyCached | KeysLeftCache | BlocksFreed
