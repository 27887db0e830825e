"""Coordinated prefix-cache eviction across the token and state pools.

A hit at ``N`` tokens needs every full-attention block of those tokens
(token pool) and a state checkpoint at exactly ``N`` (state pool); each pool
evicts by its own order, so without coordination one keeps entries the other
made useless. :class:`PrefixCacheCoupling` keeps the links up to date from
the pools' events and evicts the free blocks that are dead: a token block no
cached checkpoint needs, a checkpoint whose attention prefix left the cache.
An entry that can still serve a hit is never evicted, so hits never drop.

Everything above the pools holds them through a :class:`PoolHandle`, which
has the coupling handle an operation's events as soon as it returns;
operations that evict several blocks are driven a block at a time, as if
each event were handled when it happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_group_id,
)

from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.events import (
    BlocksFreed,
    CacheEvent,
    KeyCached,
    KeysLeftCache,
)
from vllm_hybrid.v1.core.pooled.links import CheckpointLinks
from vllm_hybrid.v1.core.pooled.policy.eviction import Entry
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
        #: events both pools recorded and the coupling has not handled yet
        self.pending: list[CacheEvent] = []
        for pool in pools:
            pool.cache_events = self.pending

    # -- events from the pools ----------------------------------------------

    def settle(self, request: Request | None = None) -> None:
        """Handle the events the pools recorded since the last call, in order
        (``request``: the one being cached, if caching recorded them). The
        coupling's own evictions record events too, handled right after."""
        pending = self.pending
        if not pending:
            return
        events = pending[:]
        pending.clear()
        for event in events:
            # by exact type: a class pattern per event costs more here
            kind = type(event)
            if kind is KeyCached:
                self.key_cached(event.kind, event.key, request, event.num_tokens)
            elif kind is KeysLeftCache:
                self.keys_left_cache(event.kind, event.keys)
            else:
                assert kind is BlocksFreed
                self.evict_dead(event.kind, event.blocks)

    def key_cached(
        self,
        kind: PoolKind,
        key: BlockHashWithGroupId,
        request: Request | None,
        num_tokens: int,
    ) -> None:
        """A state checkpoint cached for ``num_tokens`` tokens of ``request``
        gets linked to its attention prefix."""
        if kind is not PoolKind.STATE or self.links.is_linked(key):
            return
        assert request is not None, "a key cached outside cache_full_blocks"
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
        if kind is PoolKind.TOKEN:
            dead = self._dead_token_blocks(blocks)
            if dead:
                # a dead token block's key is needed by no checkpoint, so its
                # eviction makes nothing else dead and needs no event
                pool.evict_unwatched(dead)
                self.evictions[kind] += len(dead)
            return
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null and self.is_dead(kind, block):
                pool.rank_entry(block, Entry.DEAD)
                self.evictions[kind] += 1
                self.settle()

    # -- rules ----------------------------------------------------------------

    def is_dead(self, kind: PoolKind, block: KVCacheBlock) -> bool:
        """Whether a free cached block of pool ``kind`` can no longer be part
        of any hit (rules in the module docstring)."""
        if kind is PoolKind.TOKEN:
            return bool(self._dead_token_blocks([block]))
        broken = self.links.broken
        extra = self.pools[kind].cached_block_hashes_by_block.get(block.block_id, ())
        return block.block_hash in broken and all(k in broken for k in extra)

    def _dead_token_blocks(self, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """:meth:`is_dead`'s free token blocks among ``blocks``, in one pass."""
        extra_of = self.pools[PoolKind.TOKEN].cached_block_hashes_by_block
        needed = self.links.nodes
        sizes = self.links.token_groups
        dead = []
        for block in blocks:
            if block.ref_cnt or block.is_null:
                continue
            key = block.block_hash
            if key is None or key in needed or extra_of.get(block.block_id):
                continue
            size = sizes.get(get_group_id(key))
            if size is not None and (block.block_hash_num_tokens or 0) % size == 0:
                dead.append(block)
        return dead

    def _evict_dead_keys(
        self, kind: PoolKind, keys: list[BlockHashWithGroupId]
    ) -> None:
        if not keys:
            return  # the common case: a key nothing depended on
        pool = self.pools[kind]
        self.evict_dead(kind, (b for k in keys for b in pool.blocks_with(k)))


#: Attributes of a :class:`PoolHandle` itself; every other one is the pool's.
_HANDLE_FIELDS = frozenset({"pool", "coupling"})
#: The pool's attributes a handle keeps a copy of: read on every prefix
#: lookup or admission, where the lookup through ``__getattr__`` would
#: triple the cost of a call; none of them changes over the pool's life
#: unless set through the handle, which renews the copy.
_COPIED = ("get_cached_block", "touch", "get_num_free_blocks", "null_block")


class PoolHandle:
    """One arena pool as everything above the pool layer holds it.

    Upstream's managers call the pools directly, so no layer above sees an
    operation end; the handle stands where they look for the pool. Each
    operation that can record prefix-cache events is the pool's, followed by
    :meth:`PrefixCacheCoupling.settle`; every other attribute is the pool's,
    read or set through the handle. Blocks keep naming the pool itself,
    which upstream's ``free_blocks`` routes by.
    """

    pool: ArenaBlockPool
    coupling: PrefixCacheCoupling | None

    def __init__(self, pool: ArenaBlockPool) -> None:
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "coupling", None)
        for name in _COPIED:
            object.__setattr__(self, name, getattr(pool, name))

    def __getattr__(self, name: str) -> Any:
        if name in _HANDLE_FIELDS:  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.pool, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # a probe wrapping one of the pool's methods must reach the pool
        if name in _HANDLE_FIELDS:
            object.__setattr__(self, name, value)
            return
        setattr(self.pool, name, value)
        if name in _COPIED:
            object.__setattr__(self, name, value)

    def _settle(self) -> None:
        if self.coupling is not None:
            self.coupling.settle()

    # -- operations that record events ------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """The pool's allocation, settled after each block leaves the
        prefix cache."""
        pool = self.pool
        blocks = pool.take_free(num_blocks)
        coupling = self.coupling
        # most blocks handed out are clean and record no event
        pending = coupling.pending if coupling is not None else None
        for block in blocks:
            pool.claim(block)
            if pending:
                coupling.settle()
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        self.pool.free_blocks(ordered_blocks)
        self._settle()

    def cache_full_blocks(self, request: Request, *args: Any, **kwargs: Any) -> None:
        self.pool.cache_full_blocks(request, *args, **kwargs)
        if self.coupling is not None:
            self.coupling.settle(request)

    def cache_partial_block(
        self, request: Request, *args: Any, **kwargs: Any
    ) -> BlockHashWithGroupId | None:
        key = self.pool.cache_partial_block(request, *args, **kwargs)
        if self.coupling is not None:
            self.coupling.settle(request)
        return key

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Upstream's eviction by id, settled after each id."""
        for block_id in block_ids:
            self.pool.evict_blocks({block_id})
            self._settle()

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        evicted = self.pool.evict_cached(block)
        self._settle()
        return evicted

    def rank_entry(
        self, block: KVCacheBlock, entry: Entry, saves: int | None = None
    ) -> None:
        self.pool.rank_entry(block, entry, saves)
        self._settle()

    def advance_in_place(self, block: KVCacheBlock) -> list[KVCacheBlock]:
        blocks = self.pool.advance_in_place(block)
        self._settle()
        return blocks

    def reset_prefix_cache(self) -> bool:
        reset = self.pool.reset_prefix_cache()
        self._settle()
        return reset
