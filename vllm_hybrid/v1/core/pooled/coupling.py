"""Coordinated prefix-cache eviction across the token and state pools.

A prefix-cache hit of a hybrid model at ``N`` tokens needs every
full-attention block of those ``N`` tokens (token pool) and a state checkpoint
taken at exactly ``N`` (state pool). Each pool evicts from its own LRU list,
so without coordination one pool keeps entries the other has already made
useless. :class:`PrefixCacheCoupling` listens to both pools' cache events,
keeps :class:`~.links.CheckpointLinks` up to date and evicts (makes clean, so
they are reused first, as :mod:`.eviction` places dead entries) the free
blocks the links show to be dead:

* a free token block is dead when it belongs to a full-attention group, holds
  exactly one full-block key and no cached checkpoint needs that key (this
  includes the tail of a finished request past its last checkpoint);
* a free state block is dead when every key it holds is *broken*: a token
  key its prefix needs has left the token pool's cache.

Blocks in use are left alone; they are checked again when freed. Entries that
can still serve a hit are never evicted by this, so it never lowers a hit
rate; it only makes room for useful entries sooner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_group_id,
)

from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.eviction import Entry
from vllm_hybrid.v1.core.pooled.links import CheckpointLinks
from vllm_hybrid.v1.core.pooled.spec import PoolKind

if TYPE_CHECKING:
    from vllm.v1.request import Request


class PrefixCacheCoupling:
    """Evicts what one pool's cache made useless in the other.

    ``token_groups`` maps each full-attention group of the token pool to its
    block size. Built on empty caches (the links start empty).
    """

    def __init__(
        self,
        token_pool: ArenaBlockPool,
        state_pool: ArenaBlockPool,
        token_groups: dict[int, int],
    ) -> None:
        pools = (token_pool, state_pool)
        assert all(
            p.enable_caching and not len(p.cached_block_hash_to_block) for p in pools
        ), "coupling needs prefix caching and empty caches"
        self.pools = {PoolKind.TOKEN: token_pool, PoolKind.STATE: state_pool}
        self.links = CheckpointLinks(token_groups, token_pool.hash_block_size)
        #: blocks evicted because of the links, per pool
        self.evictions = {PoolKind.TOKEN: 0, PoolKind.STATE: 0}

    # -- events from the pools ----------------------------------------------

    def key_cached(
        self,
        kind: PoolKind,
        key: BlockHashWithGroupId,
        request: Request,
        num_tokens: int,
    ) -> None:
        """A pool cached ``key`` for the first ``num_tokens`` tokens of
        ``request``; a state checkpoint gets linked to its attention prefix."""
        if kind is not PoolKind.STATE or self.links.is_linked(key):
            return
        # a key maps to at least one block while it is cached
        cached = self.pools[PoolKind.TOKEN].cached_block_hash_to_block._cache
        self.links.link_if_cached(
            key, request.block_hashes, num_tokens, cached.__contains__
        )

    def keys_left_cache(self, kind: PoolKind, keys: list[BlockHashWithGroupId]) -> None:
        """Keys no block of pool ``kind`` holds any more: update the links
        and evict the free blocks that became dead in either pool."""
        links = self.links
        if kind is PoolKind.STATE:
            orphans = [t for k in keys for t in links.forget_state(k)]
            self._evict_dead_keys(PoolKind.TOKEN, orphans)
            return
        broken: list[BlockHashWithGroupId] = []
        orphans = []
        for key in keys:
            if links.is_needed(key):  # only needed keys are linked
                states, lost = links.forget_token(key)
                broken += states
                orphans += lost
        self._evict_dead_keys(PoolKind.STATE, broken)
        self._evict_dead_keys(PoolKind.TOKEN, orphans)

    def evict_dead(self, kind: PoolKind, blocks: Iterable[KVCacheBlock]) -> None:
        """Evict the free ones among ``blocks`` of pool ``kind`` that are dead."""
        pool = self.pools[kind]
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null and self.is_dead(kind, block):
                pool.rank_entry(block, Entry.DEAD)
                self.evictions[kind] += 1

    # -- rules ----------------------------------------------------------------

    def is_dead(self, kind: PoolKind, block: KVCacheBlock) -> bool:
        """Whether a cached block of pool ``kind`` can no longer be part of
        any hit (rules in the module docstring)."""
        if block.block_hash is None:
            return False
        links = self.links
        pool = self.pools[kind]
        extra = pool.cached_block_hashes_by_block.get(block.block_id, ())
        if kind is PoolKind.STATE:
            return block.block_hash in links.broken and all(
                k in links.broken for k in extra
            )
        key = block.block_hash
        if extra or not links.couples(key) or links.is_needed(key):
            return False
        size = links.token_groups[get_group_id(key)]
        return (block.block_hash_num_tokens or 0) % size == 0

    def check(self) -> None:
        """Raise AssertionError if links, caches and free queues disagree."""
        token, state = self.pools[PoolKind.TOKEN], self.pools[PoolKind.STATE]
        self.links.check(state.cached_keys(), set(token.cached_keys()))
        for kind, pool in self.pools.items():
            for i in pool.free_block_queue.cached_ids():
                if self.is_dead(kind, pool.blocks[i]):
                    raise AssertionError(
                        f"{kind.value}: dead block {i} kept in the prefix cache"
                    )

    def _evict_dead_keys(
        self, kind: PoolKind, keys: list[BlockHashWithGroupId]
    ) -> None:
        if not keys:
            return  # the common case: a key nothing depended on
        pool = self.pools[kind]
        self.evict_dead(kind, (b for k in keys for b in pool.blocks_with(k)))
