"""Links between state checkpoints and the attention blocks they resume from.

A prefix-cache hit of a hybrid model at ``N`` tokens needs two things: every
full-attention block of those ``N`` tokens (token pool) and a state
checkpoint taken at exactly ``N`` (state pool). Upstream's single pool evicts
both kinds from one LRU list; pooled mode has one list per pool, so without
coordination each pool could keep entries the other has already made useless:

* an attention block that no cached checkpoint at or after it needs can never
  be part of a hit (the hit length is capped by the last checkpoint); and
* a checkpoint whose attention prefix lost a block can never be hit either.

:class:`CheckpointLinks` records, for each cached checkpoint key, the
full-attention block keys its prefix consists of, and the reverse. The arena
pools tell it when keys appear and disappear, and evict (make clean, so they
are reused first) the free blocks the links show to be dead. Entries that can
still serve a hit are never evicted by this, so it never lowers a hit rate;
it only makes room for useful entries sooner.

Rules, with ``keys(b)`` the prefix-cache keys a block holds:

* a free token block is dead when it belongs to a full-attention group, holds
  exactly one full-block key and no cached checkpoint needs that key (this
  includes the tail of a finished request past its last checkpoint);
* a free state block is dead when every key it holds is *broken*: a token
  key its prefix needs has left the token pool's cache.

Blocks in use are left alone; they are checked again when freed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    get_group_id,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)

TokenKey = BlockHashWithGroupId
StateKey = BlockHashWithGroupId


@dataclass
class CheckpointLinks:
    """Which full-attention block keys each cached state checkpoint needs.

    Pure bookkeeping over prefix-cache keys; the pools act on its answers.
    """

    #: block size of each full-attention group in the token pool, by group id
    token_groups: dict[int, int]
    #: granularity of ``Request.block_hashes``
    hash_block_size: int
    needs: dict[StateKey, tuple[TokenKey, ...]] = field(default_factory=dict)
    needed_by: dict[TokenKey, set[StateKey]] = field(default_factory=dict)
    #: checkpoint keys still cached whose attention prefix is incomplete
    broken: set[StateKey] = field(default_factory=set)
    #: blocks evicted because of the links, per pool
    evictions: dict[str, int] = field(default_factory=lambda: {"token": 0, "state": 0})

    def token_keys(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> tuple[TokenKey, ...]:
        """Keys of the full-attention blocks wholly inside the first
        ``num_tokens`` tokens, in every full-attention group."""
        keys: list[TokenKey] = []
        for group_id, block_size in self.token_groups.items():
            hashes = resolve_block_hashes(
                block_hashes, self.hash_block_size, block_size
            )
            count = min(num_tokens // block_size, len(hashes))
            keys.extend(
                make_block_hash_with_group_id(hashes[i], group_id) for i in range(count)
            )
        return tuple(keys)

    def link(self, state_key: StateKey, token_keys: tuple[TokenKey, ...]) -> None:
        """Record a newly cached checkpoint; idempotent for a key already
        linked (duplicate blocks share one key)."""
        if state_key in self.needs:
            return
        self.broken.discard(state_key)
        self.needs[state_key] = token_keys
        for token_key in token_keys:
            self.needed_by.setdefault(token_key, set()).add(state_key)

    def link_incomplete(self, state_key: StateKey) -> None:
        """A checkpoint cached while part of its attention prefix is not:
        broken from the start, unless the key is already linked."""
        if state_key not in self.needs:
            self.broken.add(state_key)

    def forget_state(self, state_key: StateKey) -> list[TokenKey]:
        """A checkpoint key left the state pool's cache. Returns the token
        keys that no checkpoint needs any more."""
        self.broken.discard(state_key)
        return self._unlink(state_key)

    def forget_token(
        self, token_key: TokenKey
    ) -> tuple[list[StateKey], list[TokenKey]]:
        """A token key left the token pool's cache. Returns the checkpoints
        this breaks and the other token keys only those checkpoints needed."""
        states = sorted(self.needed_by.pop(token_key, ()))
        orphans: list[TokenKey] = []
        for state_key in states:
            self.broken.add(state_key)
            orphans.extend(self._unlink(state_key))
        return states, orphans

    def is_needed(self, token_key: TokenKey) -> bool:
        return token_key in self.needed_by

    def couples(self, token_key: TokenKey) -> bool:
        """Whether the key belongs to a full-attention group (the only token
        groups a checkpoint's hit depends on block by block)."""
        return get_group_id(token_key) in self.token_groups

    def clear(self) -> None:
        self.needs.clear()
        self.needed_by.clear()
        self.broken.clear()

    def check(self, state_keys: Iterable[StateKey], token_keys: set[TokenKey]) -> None:
        """Raise AssertionError if the links disagree with the caches
        (``state_keys``/``token_keys``: keys cached in each pool now)."""
        cached_states = set(state_keys)
        for state_key, needed in self.needs.items():
            assert state_key in cached_states, "linked checkpoint not cached"
            assert state_key not in self.broken, "checkpoint linked and broken"
            for token_key in needed:
                assert token_key in token_keys, "checkpoint needs an evicted block"
                assert state_key in self.needed_by[token_key], "links asymmetric"
        for token_key, users in self.needed_by.items():
            assert users, "empty needed_by entry"
            assert all(token_key in self.needs[s] for s in users), "asymmetric"
        assert self.broken <= cached_states, "broken key no longer cached"

    def _unlink(self, state_key: StateKey) -> list[TokenKey]:
        orphans = []
        for token_key in self.needs.pop(state_key, ()):
            users = self.needed_by.get(token_key)
            if users is None:
                continue
            users.discard(state_key)
            if not users:
                del self.needed_by[token_key]
                orphans.append(token_key)
        return orphans
