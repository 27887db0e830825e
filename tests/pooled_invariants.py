"""The arena's bookkeeping checked whole, for tests: ownership, free queues,
segments and the prefix-cache coupling agree.

Tests and test scripts call :func:`check_invariants` after every step or
workload; the package itself never does. :func:`ensure` and
:func:`can_allocate` drive the boundary directly, one way at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.block_pool import ArenaBlockPool
from vllm_hybrid.v1.core.pooled.boundary import ArenaBoundary
from vllm_hybrid.v1.core.pooled.coupling import PrefixCacheCoupling
from vllm_hybrid.v1.core.pooled.free_queue import ArenaFreeBlockQueue
from vllm_hybrid.v1.core.pooled.links import CheckpointLinks, StateKey, TokenKey
from vllm_hybrid.v1.core.pooled.policy.eviction import Reach, Segment
from vllm_hybrid.v1.core.pooled.spec import PoolKind

# -- a free queue's blocks by segment, in hand-out order ----------------------


def clean_ids(queue: ArenaFreeBlockQueue) -> list[int]:
    """Ids of clean free blocks (those next to the boundary last)."""
    return [b.block_id for b in queue.get_all_free_blocks() if b.block_hash is None]


def cached_ids(queue: ArenaFreeBlockQueue) -> list[int]:
    """Ids of cached free blocks."""
    return [b.block_id for b in queue.get_all_free_blocks() if b.block_hash is not None]


def protected_ids(queue: ArenaFreeBlockQueue) -> list[int]:
    """Ids of the protected segment."""
    return [b.block_id for b in queue.get_all_free_blocks() if queue.is_protected(b)]


def clean_at_boundary_ids(queue: ArenaFreeBlockQueue) -> list[int]:
    """Ids of the clean blocks filed as next to the boundary."""
    return queue._ids_of(Segment.CLEAN_AT_BOUNDARY)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_invariants(arena: KVArena) -> None:
    """Raise AssertionError if the arena's bookkeeping is inconsistent."""
    layout = arena.layout
    s_floor = arena.boundary.state_floor
    _require(
        layout.min_state_floor <= s_floor <= layout.max_state_floor,
        f"state floor {s_floor} outside [{layout.min_state_floor}, "
        f"{layout.max_state_floor}]",
    )
    token_ids, state_ids = arena.token_pool.owned_ids, arena.state_pool.owned_ids
    _require(token_ids == layout.token_ids_at(s_floor), "token ownership drift")
    _require(state_ids == layout.state_ids_at(s_floor), "state ownership drift")
    if token_ids and state_ids:
        _require(
            token_ids.stop * layout.token_block_bytes
            <= layout.state_offset + state_ids.start * layout.state_block_bytes,
            "a byte is owned by both pools",
        )
    _require(
        token_ids.start >= layout.first_token_id
        and state_ids.start >= layout.first_state_id,
        "a pool owns a null or reserved id",
    )
    _require(
        state_ids.stop == layout.num_state_ids
        and token_ids.stop <= layout.num_token_ids,
        "a pool owns ids past the arena",
    )
    for handle in (arena.token_pool, arena.state_pool):
        check_pool(handle.pool)
    if arena.coupling is not None:
        check_coupling(arena.coupling)


def check_pool(pool: ArenaBlockPool) -> None:
    """One pool's part of :func:`check_invariants`: its free queue holds
    exactly its owned blocks at reference 0, each in the right segment."""
    name = pool.side.value
    queue = pool.free_block_queue
    owned = pool.owned_ids
    _require(pool.null_block is pool.blocks[0] and pool.null_block.is_null, "null")
    _require(pool.null_block not in queue, f"{name}: null block in free queue")
    free_ids = set(clean_ids(queue)) | set(cached_ids(queue))
    _require(len(free_ids) == queue.num_free_blocks, f"{name}: queue count")
    expected = {i for i in owned if pool.blocks[i].ref_cnt == 0}
    _require(free_ids == expected, f"{name}: free queue != owned blocks at ref 0")
    used = sum(1 for i in owned if pool.blocks[i].ref_cnt > 0)
    _require(
        queue.num_free_blocks + used == pool.owned_capacity,
        f"{name}: free + used != owned capacity",
    )
    for i in clean_ids(queue):
        _require(pool.blocks[i].block_hash is None, f"{name}: hashed block {i} clean")
    policy = queue.policy
    held = policy.held_from
    _require(
        set(clean_at_boundary_ids(queue))
        == {i for i in clean_ids(queue) if held is not None and i >= held},
        f"{name}: clean blocks next to the boundary filed apart from the rest",
    )
    for i in cached_ids(queue):
        block = pool.blocks[i]
        _require(block.block_hash is not None, f"{name}: cached {i} no hash")
        _require(
            queue.is_protected(block) == policy.is_proven(block),
            f"{name}: cached block {i} in the wrong LRU segment",
        )
    for i in policy.hit_counts():
        _require(pool.blocks[i].block_hash is not None, f"{name}: hits of clean {i}")
    for i, block in enumerate(pool.blocks):
        _require(block.block_id == i, f"{name}: block {block.block_id} at id {i}")
    for block in pool.blocks[1:]:
        _require(block.ref_cnt >= 0, f"{name}: block {block.block_id} ref_cnt < 0")
        if block.block_id not in owned:
            _require(
                block.ref_cnt == 0
                and block.block_hash is None
                and block.block_id not in pool.cached_block_hashes_by_block,
                f"{name}: unowned block {block.block_id} is in use or cached",
            )


def check_coupling(coupling: PrefixCacheCoupling) -> None:
    """Links, caches and free queues agree, and no event was left unhandled
    (a pool called around its handle)."""
    _require(not coupling.pending, f"unhandled prefix-cache events: {coupling.pending}")
    token = coupling.pools[PoolKind.TOKEN]
    state = coupling.pools[PoolKind.STATE]
    check_links(coupling.links, state.cached_keys(), set(token.cached_keys()))
    for kind, pool in coupling.pools.items():
        for i in cached_ids(pool.free_block_queue):
            _require(
                not coupling.is_dead(kind, pool.blocks[i]),
                f"{kind.value}: dead block {i} kept in the prefix cache",
            )


def needs(links: CheckpointLinks) -> dict[StateKey, tuple[TokenKey, ...]]:
    """Every token key each linked checkpoint needs, each group's chain
    from its first block down to the checkpoint's tip."""
    out: dict[StateKey, tuple[TokenKey, ...]] = {}
    for state_key, tips in links.tips.items():
        keys: list[TokenKey] = []
        for tip in tips:
            chain: list[TokenKey] = []
            token_key: TokenKey | None = tip
            while token_key is not None:
                chain.append(token_key)
                token_key = links.nodes[token_key][0]
            keys.extend(reversed(chain))
        out[state_key] = tuple(keys)
    return out


def check_links(
    links: CheckpointLinks,
    state_keys: Iterable[StateKey],
    token_keys: set[TokenKey],
) -> None:
    """The links agree with the caches (``state_keys``/``token_keys``: the
    keys each pool caches now) and their tree is symmetric."""
    cached_states = set(state_keys)
    needed_keys = needs(links)
    for state_key, needed in needed_keys.items():
        _require(state_key in cached_states, "linked checkpoint not cached")
        _require(state_key not in links.broken, "checkpoint linked and broken")
        for token_key in needed:
            _require(token_key in token_keys, "checkpoint needs an evicted block")
    ends = {(t, s) for s, tips in links.tips.items() for t in tips}
    for token_key, state_key in ends:
        _require(state_key in links.ends[token_key], "links asymmetric")
    for token_key, users in links.ends.items():
        _require(bool(users), "empty ends entry")
        _require(all((token_key, s) in ends for s in users), "asymmetric")
    for token_key, kids in links.kids.items():
        _require(bool(kids), "empty kids entry")
        for kid in kids:
            _require(links.nodes[kid][0] == token_key, "tree asymmetric")
    for token_key, (parent, _) in links.nodes.items():
        _require(token_key in links.ends or token_key in links.kids, "unneeded key")
        if parent is not None:
            _require(token_key in links.kids[parent], "tree asymmetric")
    needed = {token_key for keys in needed_keys.values() for token_key in keys}
    _require(needed == set(links.nodes), "needed keys disagree")
    _require(links.broken <= cached_states, "broken key no longer cached")


def needed_by(links: CheckpointLinks) -> dict[TokenKey, set[StateKey]]:
    """The checkpoints needing each token key: the links read backwards."""
    users: dict[TokenKey, set[StateKey]] = {}
    for state_key, keys in needs(links).items():
        for token_key in keys:
            users.setdefault(token_key, set()).add(state_key)
    return users


def can_allocate(
    boundary: ArenaBoundary,
    need_token: int,
    need_state: int,
    keep: Sequence[KVCacheBlock] = (),
) -> bool:
    """Whether both pools can hand out that many blocks, reaching every
    free block and counting at most one boundary move. Changes nothing."""
    return boundary._plan(need_token, need_state, keep, Reach.ANY) is not None


def ensure(
    boundary: ArenaBoundary,
    need_token: int,
    need_state: int,
    keep: Sequence[KVCacheBlock] = (),
    reach: Reach = Reach.ANY,
) -> bool:
    """Make both pools have that many free blocks within ``reach``, moving
    the boundary if needed, all or nothing: one way of the boundary's plan,
    carried out. Returns whether it succeeded."""
    found = boundary._plan(need_token, need_state, keep, reach)
    if found is not None:
        boundary.carry_out(found)
    return found is not None
