"""Which full-attention blocks each cached state checkpoint needs, so that
:mod:`.coupling` can tell which cached entries one pool made useless. Pure
bookkeeping over prefix-cache keys, kept as one tree per group since block
hashes are chained (docs/pooled-mode.md, "Coordinated eviction").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)

TokenKey = BlockHashWithGroupId
StateKey = BlockHashWithGroupId
#: One group's prefix: its number of keys, its block hashes and the bytes
#: that make a hash its key in the group.
Chain = tuple[int, Sequence[BlockHash], bytes]
#: A group's prefix being linked: its number of keys, its keys not in the
#: tree yet (deepest first) and the deepest key already there (or None).
Path = tuple[int, list[TokenKey], TokenKey | None]


@dataclass
class CheckpointLinks:
    """Which full-attention block keys each cached state checkpoint needs."""

    #: block size of each full-attention group in the token pool, by group id
    token_groups: dict[int, int]
    #: granularity of ``Request.block_hashes``
    hash_block_size: int
    #: deepest needed key of each linked checkpoint, per group (in group
    #: order; groups its prefix has no full block of are left out)
    tips: dict[StateKey, tuple[TokenKey, ...]] = field(default_factory=dict)
    #: every needed token key: the key of the block before it (None for a
    #: first block) and its index in the chain
    nodes: dict[TokenKey, tuple[TokenKey | None, int]] = field(default_factory=dict)
    #: needed keys of the next block, for the keys that have any
    kids: dict[TokenKey, set[TokenKey]] = field(default_factory=dict)
    #: checkpoints whose prefix in a group ends at a key, for those keys
    ends: dict[TokenKey, set[StateKey]] = field(default_factory=dict)
    #: checkpoint keys still cached whose attention prefix is incomplete
    broken: set[StateKey] = field(default_factory=set)

    def is_linked(self, state_key: StateKey) -> bool:
        return state_key in self.tips

    def link_if_cached(
        self,
        state_key: StateKey,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        is_cached: Callable[[TokenKey], bool],
    ) -> None:
        """Record a newly cached checkpoint for the first ``num_tokens``
        tokens of ``block_hashes``, or as broken when one of its attention
        blocks is not cached (``is_cached``). A linked key is left alone
        (duplicate blocks share one)."""
        if state_key in self.tips:
            return
        nodes = self.nodes
        paths: list[Path] = []
        for count, hashes, suffix in self._chains(block_hashes, num_tokens):
            if not count:
                continue
            new: list[TokenKey] = []
            known: TokenKey | None = None
            for i in range(count - 1, -1, -1):
                token_key = TokenKey(hashes[i] + suffix)
                if token_key in nodes:
                    known = token_key
                    break
                if not is_cached(token_key):
                    self.broken.add(state_key)
                    return
                new.append(token_key)
            paths.append((count, new, known))
        self._attach(state_key, paths)

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
        if token_key not in self.nodes:
            return [], []
        states: list[StateKey] = []
        below = [token_key]
        while below:
            key = below.pop()
            states.extend(self.ends.get(key, ()))
            below.extend(self.kids.get(key, ()))
        states.sort()
        orphans: list[TokenKey] = []
        for state_key in states:
            self.broken.add(state_key)
            orphans.extend(self._unlink(state_key, skip=token_key))
        return states, orphans

    def is_needed(self, token_key: TokenKey) -> bool:
        return token_key in self.nodes

    def _chains(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> list[Chain]:
        """Each full-attention group's keys of the first ``num_tokens``."""
        chains: list[Chain] = []
        for group_id, block_size in self.token_groups.items():
            hashes = resolve_block_hashes(
                block_hashes, self.hash_block_size, block_size
            )
            count = min(num_tokens // block_size, len(hashes))
            # a key is its hash followed by the group's bytes (upstream's
            # packing), made once here rather than per key
            suffix = make_block_hash_with_group_id(BlockHash(b""), group_id)
            chains.append((count, hashes, suffix))
        return chains

    def _attach(self, state_key: StateKey, paths: list[Path]) -> None:
        """Link ``state_key`` below the keys of ``paths`` (all cached)."""
        self.broken.discard(state_key)
        nodes, kids = self.nodes, self.kids
        tips: list[TokenKey] = []
        for count, new, known in paths:
            index = count - 1
            child: TokenKey | None = None
            for j, token_key in enumerate(new):
                parent = new[j + 1] if j + 1 < len(new) else known
                nodes[token_key] = (parent, index - j)
                if child is not None:
                    kids[token_key] = {child}
                child = token_key
            if known is not None:
                depth = index - len(new)
                assert nodes[known][1] == depth, "block hashes are not chained"
                if child is not None:
                    kids.setdefault(known, set()).add(child)
            tip = new[0] if new else known
            assert tip is not None
            self.ends.setdefault(tip, set()).add(state_key)
            tips.append(tip)
        self.tips[state_key] = tuple(tips)

    def _unlink(
        self, state_key: StateKey, skip: TokenKey | None = None
    ) -> list[TokenKey]:
        """Drop a checkpoint; returns the keys no longer needed (but
        ``skip``), each chain's first block first."""
        orphans: list[TokenKey] = []
        nodes, kids, ends = self.nodes, self.kids, self.ends
        for tip in self.tips.pop(state_key, ()):
            users = ends[tip]
            users.discard(state_key)
            if users:
                continue
            del ends[tip]
            gone: list[TokenKey] = []
            token_key: TokenKey | None = tip
            # Walk up while the key has no checkpoint and no needed kid left.
            while token_key is not None and token_key not in kids:
                if token_key in ends:
                    break
                parent = nodes.pop(token_key)[0]
                if token_key != skip:
                    gone.append(token_key)
                if parent is not None:
                    siblings = kids[parent]
                    siblings.discard(token_key)
                    if not siblings:
                        del kids[parent]
                token_key = parent
            gone.reverse()
            orphans.extend(gone)
        return orphans
