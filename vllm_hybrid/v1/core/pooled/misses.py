"""Which evicted entries a prefix lookup asked for again.

After the coordinator's lookup found a request's hit, each pool hears which
of its ghosts (the keys of entries it evicted for room, ``policy.ghosts``)
lie in the request's prompt past the hit: a key hashes the whole prefix up
to its block, so a match means this prompt shares the evicted entry's
prefix, and the entry would have made the hit longer.

The whole prompt past the hit is read, not only the first block missing:
with the pools' prefix caches coupled, one eviction for room takes with it
the entries only it made useful (attention blocks no kept state needs, a
state whose attention prefix is gone), and those go as dead entries without
a ghost. The first block a lookup misses is then often a dead one; the
eviction that lost the hit is a ghost further on, in either pool.

Per pool, the first ghost past the hit counts, with the tokens between the
hit and its end (what the eviction cost this lookup); every ghost the lookup
passes is forgotten, since the request computes and caches those blocks
again. Nothing here changes what the lookup returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashListWithBlockSize,
    make_block_hash_with_group_id,
)

from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool


def _hashes(
    block_hashes: Sequence[BlockHash], hash_block: int, block: int
) -> Sequence[BlockHash]:
    """The request's hashes at a group's block size."""
    if block == hash_block:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block, block)


def ask_ghosts(
    block_hashes: Sequence[BlockHash],
    hash_block: int,
    hit_length: int,
    max_length: int,
    groups: Sequence[tuple[int, int, ArenaBlockPool]],
) -> None:
    """Ask the ghosts of each group's pool for the blocks past ``hit_length``
    of a prompt whose hit could be at most ``max_length`` tokens (module
    docstring). ``groups``: (group id, block size, pool) of the groups whose
    evictions are followed."""
    for group_id, block, pool in groups:
        ghosts = pool.ghosts
        if ghosts is None or not ghosts.keys:
            continue
        hashes = _hashes(block_hashes, hash_block, block)
        stop = min(max_length // block, len(hashes))
        first = None
        for index in range(hit_length // block, stop):
            key = make_block_hash_with_group_id(hashes[index], group_id)
            if ghosts.forget(key) and first is None:
                first = index
        if first is not None:
            ghosts.lost((first + 1) * block - hit_length)
