"""Turn-end and prefill state checkpoints kept in the prefix cache.

In align mode upstream caches a state only at a prompt's replay boundaries
and shared-prefix junctions. A chat follow-up's longest possible hit is the
last edge the previous turn reached while decoding (the turn end), which
upstream never keeps. This mixin keeps each request's latest decode
checkpoint cached, evicts the previous one when a later edge is cached
(unless the retention interval keeps it or another request uses it), and
ranks it as a turn end once freed. It also notes the prefill checkpoints a
chunk ended on, to rank them once the request moves past them.

Which positions are kept and how they rank is the policy's
(:mod:`vllm_hybrid.v1.core.pooled.policy`); docs/pooled-mode.md ("Turn-end
checkpoints") has the design.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.request import Request

from vllm_hybrid.v1.core.pooled.policy.eviction import Entry, rank_entry
from vllm_hybrid.v1.core.pooled.policy.positions import (
    CheckpointPolicy,
    decode_checkpoint_edge,
    replay_positions,
    saved_tokens,
)

#: Whether each manager class is a MambaManager (``isinstance`` on an ABC is
#: slow, and this is asked for every group at every step).
_IS_MAMBA: dict[type, bool] = {}


def _align_mode(manager: SingleTypeKVCacheManager) -> bool:
    """Whether ``manager`` is an align-mode state (Mamba) manager."""
    cls = type(manager)
    mamba = _IS_MAMBA.get(cls)
    if mamba is None:
        mamba = _IS_MAMBA[cls] = isinstance(manager, MambaManager)
    return mamba and manager.mamba_cache_mode == "align"


@dataclass
class DecodeCheckpoint:
    """A decode (or prefill) checkpoint a request cached in one state group."""

    block: KVCacheBlock
    #: The block's cache key when cached (it may have been reused since).
    block_hash: BlockHashWithGroupId | None
    #: Tokens the checkpoint covers (a state block edge).
    num_tokens: int
    #: Ranked as a turn end in its pool's eviction order once freed.
    ranked: bool = False
    #: How a prefill or prompt checkpoint ranks once freed (None: turn end).
    entry: Entry | None = None
    #: Tokens of recomputation a hit on it saves.
    saves: int | None = None


@dataclass
class TurnEndCounts:
    """What turn-end retention did, for benchmarks and tests."""

    #: Decode checkpoints cached (per state group).
    cached: int = 0
    #: Earlier decode checkpoints evicted when a later one was cached.
    superseded: int = 0
    #: Earlier decode checkpoints kept: another request used them, or the
    #: retention interval keeps their edge.
    kept: int = 0
    #: Decode checkpoints ranked as turn ends once freed.
    ranked_first: int = 0
    by_request: dict[str, dict[int, DecodeCheckpoint]] = field(default_factory=dict)
    #: Prefill checkpoints cached (per state group).
    prefill_cached: int = 0
    #: Prefill checkpoints of running requests not ranked yet, by group.
    prefill_by_request: dict[str, list[tuple[int, DecodeCheckpoint]]] = field(
        default_factory=dict
    )


class TurnEndRetentionMixin:
    """Keeps each request's latest decode checkpoint cached (module doc).

    For subclasses of upstream's ``KVCacheCoordinator`` with prefix caching;
    their constructor calls :meth:`_init_turn_ends`.
    """

    single_type_managers: tuple[SingleTypeKVCacheManager, ...]
    scheduler_block_size: int
    retention_interval: int | None
    eagle_group_ids: set[int]

    def _init_turn_ends(self, policy: CheckpointPolicy) -> None:
        #: Which positions keep a state and how freed ones rank (the single
        #: pool copies at every edge anyway and keeps the latest).
        self.checkpoint_policy = policy
        #: Requests seen by :meth:`cache_blocks`, until freed: what
        #: :meth:`keeps_edge` reads (prompt length, token budget).
        self._requests: dict[str, Request] = {}
        #: Per request and state group, the position of the latest state it
        #: kept or started from (its prefix hit): what its next checkpoint
        #: saves is measured from there.
        self._kept_at: dict[str, dict[int, int]] = {}
        self.turn_end_counts = TurnEndCounts()

    @cached_property
    def _caching(
        self,
    ) -> tuple[tuple[int, SingleTypeKVCacheManager, int, bool], ...]:
        """(group id, manager, the token multiple at which caching does
        anything without a filled block (:func:`_unfilled_unit`), whether it
        is an align-mode state group) per caching group."""
        return tuple(
            (group_id, manager, _unfilled_unit(manager), _align_mode(manager))
            for group_id, manager in enumerate(self.single_type_managers)
            if manager.enable_caching
        )

    @cached_property
    def _block_counts(self) -> tuple[tuple[int, int, dict[str, int]], ...]:
        """(group id, block size, cached blocks per request) per caching group."""
        return tuple(
            (group_id, manager.block_size, manager.num_cached_block)
            for group_id, manager in enumerate(self.single_type_managers)
            if manager.enable_caching
        )

    def _fills_a_block(self, request_id: str, cacheable: Sequence[int]) -> bool:
        """Whether caching ``cacheable`` tokens per group reaches a block some
        group has not cached yet (if none does, no kept position is new)."""
        for group_id, block_size, cached in self._block_counts:
            if cacheable[group_id] // block_size > cached.get(request_id, 0):
                return True
        return False

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        """Upstream's, noting the prefix hit a request starts from, which its
        first checkpoint's savings are measured from."""
        super().allocate_new_computed_blocks(
            request_id,
            new_computed_blocks,
            num_local_computed_tokens,
            num_external_computed_tokens,
            skip_zeroing_group_ids,
        )
        self._kept_at[request_id] = dict.fromkeys(
            range(len(self.single_type_managers)), num_local_computed_tokens
        )

    def _saves(self, request_id: str, group_id: int, position: int) -> int:
        """Tokens a checkpoint at ``position`` saves over the previous one the
        request kept in this group (or its prefix hit)."""
        return saved_tokens(
            self._kept_at.get(request_id, {}).get(group_id, 0), position
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Upstream's caching, with the policy's decode and prefill
        checkpoints as more boundaries of align-mode state groups."""
        self._requests[request.request_id] = request
        policy = self.checkpoint_policy
        if not policy.adds_positions:
            super().cache_blocks(request, num_computed_tokens)
            for manager in self.single_type_managers:
                if _align_mode(manager):
                    _drop_in_place_key(manager, request.request_id)
            return
        managers = self.single_type_managers
        rid = request.request_id
        if self.eagle_group_ids:
            cacheable = [
                self.get_num_cacheable_tokens(num_computed_tokens, group_id)
                for group_id in range(len(managers))
            ]
        else:  # every group caches the same prefix
            cacheable = [self.get_num_cacheable_tokens(num_computed_tokens, 0)] * len(
                managers
            )
        at_prompt_end = num_computed_tokens == request.num_prompt_tokens
        if not at_prompt_end and not self._fills_a_block(rid, cacheable):
            # Most steps: no group filled a block, so no kept position was
            # reached; only upstream's per-step work remains (the prompt's end
            # notes its own checkpoint, which may have its key only by then).
            for group_id, manager, unit, align in self._caching:
                if unit and cacheable[group_id] % unit == 0:
                    manager.cache_blocks(
                        request,
                        cacheable[group_id],
                        retention_interval=self.retention_interval,
                        replay_boundaries=(),
                    )
                if align:
                    _drop_in_place_key(manager, rid)
            return
        replay = replay_positions(
            request, self.scheduler_block_size, bool(self.eagle_group_ids)
        )
        for group_id, manager in enumerate(managers):
            if not manager.enable_caching:
                continue
            num_tokens = cacheable[group_id]
            # asked once per group: the checks below run at every step
            align = _align_mode(manager)
            positions = policy.state_positions(
                request,
                num_tokens,
                manager.block_size,
                self.retention_interval,
                replay,
                align,
            )
            manager.cache_blocks(
                request,
                num_tokens,
                retention_interval=self.retention_interval,
                replay_boundaries=positions.boundaries,
            )
            if align:
                _drop_in_place_key(manager, request.request_id)
            if positions.turn_end:
                self._supersede(
                    group_id,
                    manager,
                    request.request_id,
                    num_tokens,
                    request.num_prompt_tokens,
                )
            elif align and policy.prefill_interval:
                self._record_prefill(
                    group_id, manager, request, num_tokens, positions.prefill
                )

    def _record_prefill(
        self,
        group_id: int,
        manager: SingleTypeKVCacheManager,
        request: Request,
        num_tokens: int,
        positions: range,
    ) -> None:
        """Note the prefill (or prompt) checkpoint a chunk ending at
        ``num_tokens`` just cached, to rank it once the request moves past
        it (``positions``: the request's prefill checkpoints)."""
        entry = self.checkpoint_policy.prompt_entry(
            num_tokens, request.num_prompt_tokens, manager.block_size, positions
        )
        if entry is None:
            return  # only a chunk ending on a checkpoint writes one
        blocks = manager.req_to_blocks.get(request.request_id) or []
        index = num_tokens // manager.block_size - 1
        if index >= len(blocks):
            return
        block = blocks[index]
        if block.is_null or block.block_hash is None:
            return
        counts = self.turn_end_counts
        noted = counts.prefill_by_request.setdefault(request.request_id, [])
        if any(c.block is block for _, c in noted):
            return
        saves = self._saves(request.request_id, group_id, num_tokens)
        self._kept_at.setdefault(request.request_id, {})[group_id] = num_tokens
        checkpoint = DecodeCheckpoint(
            block, block.block_hash, num_tokens, entry=entry, saves=saves
        )
        noted.append((group_id, checkpoint))
        if entry is not Entry.PROMPT:
            counts.prefill_cached += 1

    def keeps_edge(self, request_id: str, edge: int, block: int) -> bool:
        """Whether a request crossing the state block edge ``edge`` must
        keep the state there in a block of its own (the policy's
        ``keeps_edge``; an unknown request keeps it). False lets the pooled
        coordinator cross the edge in place."""
        request = self._requests.get(request_id)
        if request is None:
            return True
        return self.checkpoint_policy.keeps_edge(
            request,
            edge,
            block,
            self.retention_interval,
            self.scheduler_block_size,
            bool(self.eagle_group_ids),
        )

    def _supersede(
        self,
        group_id: int,
        manager: SingleTypeKVCacheManager,
        request_id: str,
        num_tokens: int,
        prompt_len: int,
    ) -> None:
        """Record the checkpoint cached for ``num_tokens``, if any, and evict
        the request's previous decode checkpoint of this group. Only edges
        past the prompt count: the prompt's own checkpoint must never be
        superseded, or a resent prompt would lose its hit.
        """
        edge = decode_checkpoint_edge(num_tokens, manager.block_size, prompt_len)
        if edge is None:
            return
        blocks = manager.req_to_blocks.get(request_id) or []
        index = edge // manager.block_size - 1
        if index < 0 or index >= len(blocks):
            return
        block = blocks[index]
        if block.is_null or block.block_hash is None:
            return
        counts = self.turn_end_counts
        latest = counts.by_request.setdefault(request_id, {})
        previous = latest.get(group_id)
        if previous is not None and previous.num_tokens == edge:
            return
        latest[group_id] = DecodeCheckpoint(
            block, block.block_hash, edge, saves=self._saves(request_id, group_id, edge)
        )
        counts.cached += 1
        if previous is None:
            return
        if self.checkpoint_policy.keeps_superseded(
            previous.num_tokens, previous.block.ref_cnt > 0, self.retention_interval
        ):
            counts.kept += 1
            return
        if previous.block.block_hash == previous.block_hash:
            rank_entry(manager.block_pool, previous.block, Entry.SUPERSEDED)
            counts.superseded += 1

    def remove_skipped_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        super().remove_skipped_blocks(request_id, *args, **kwargs)
        latest = self.turn_end_counts.by_request.get(request_id)
        if latest:
            self._rank_turn_ends(latest)
        noted = self.turn_end_counts.prefill_by_request.get(request_id)
        if noted:
            noted[:] = self._rank_prefill(noted)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._kept_at.pop(request_id, None)
        latest = self.turn_end_counts.by_request.pop(request_id, None)
        noted = self.turn_end_counts.prefill_by_request.pop(request_id, None)
        super().free(request_id)
        if latest:
            self._rank_turn_ends(latest)
        if noted:
            self._rank_prefill(noted)

    def _rank_prefill(
        self, noted: list[tuple[int, DecodeCheckpoint]]
    ) -> list[tuple[int, DecodeCheckpoint]]:
        """Rank the freed ones of ``noted`` as prefill checkpoints in their
        pool's eviction order; the ones still held stay noted."""
        held = []
        for group_id, checkpoint in noted:
            block = checkpoint.block
            if block.block_hash != checkpoint.block_hash:
                continue  # evicted and reused since
            if block.ref_cnt:
                held.append((group_id, checkpoint))
                continue
            pool = self.single_type_managers[group_id].block_pool
            rank_entry(pool, block, checkpoint.entry or Entry.PREFILL, checkpoint.saves)
        return held

    def _rank_turn_ends(self, latest: dict[int, DecodeCheckpoint]) -> None:
        """Rank freed decode checkpoints as turn ends (where they go is
        :data:`~vllm_hybrid.v1.core.pooled.policy.eviction.PLACES`'s)."""
        for group_id, checkpoint in latest.items():
            block = checkpoint.block
            if (
                checkpoint.ranked
                or block.ref_cnt
                or block.block_hash != checkpoint.block_hash
            ):
                continue  # done, still held, or no longer this checkpoint
            pool = self.single_type_managers[group_id].block_pool
            rank_entry(pool, block, Entry.TURN_END, checkpoint.saves)
            checkpoint.ranked = True
            self.turn_end_counts.ranked_first += 1

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._requests.pop(request_id, None)
        self._kept_at.pop(request_id, None)
        self.turn_end_counts.by_request.pop(request_id, None)
        self.turn_end_counts.prefill_by_request.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def _unfilled_unit(manager: SingleTypeKVCacheManager) -> int:
    """The token multiple at which upstream's ``cache_blocks`` of ``manager``
    may cache anything for a request that filled no new block: never (0)
    for a full-attention group whose block is the hash block; on hash block
    edges for an align-mode state group without in-chunk prefill
    checkpoints (only its partial tail block, which ends on one, is cached
    there); else at any call (1)."""
    hash_block = manager.block_pool.hash_block_size
    if type(manager) is FullAttentionManager:
        return 0 if manager.block_size == hash_block else 1
    if _align_mode(manager) and not manager.has_prefill_checkpoint_blocks:
        return hash_block
    return 1


def _drop_in_place_key(manager: SingleTypeKVCacheManager, request_id: str) -> None:
    """Take the cache key off a state block the request just advanced in
    place, if caching gave it one: the block's content moves on this step,
    so a hit under the edge's key would start from a state past the edge.
    """
    blocks = manager.req_to_blocks.get(request_id)
    if not blocks or len(blocks) < 2:
        return
    running = blocks[-1]
    if running is blocks[-2] and running.block_hash is not None:
        manager.block_pool.evict_blocks({running.block_id})
