"""Links between state checkpoints and the attention blocks they resume from.

:class:`CheckpointLinks` records, for each cached checkpoint key, the
full-attention block keys its prefix consists of, and the reverse, so that
:mod:`.coupling` can tell which cached entries of one pool the other pool has
made useless. Pure bookkeeping over prefix-cache keys: no pools, no blocks.
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
