"""Coordinators for pooled mode: one arena, a token pool and a state pool.

Upstream's coordinators build one ``BlockPool`` and hand it to every group's
manager. The pooled coordinators let upstream build everything, then bind each
manager to the pool of its page kind from a :class:`KVArena`, and decide
admission jointly: a request fits when the token pool and the state pool can
both serve it, possibly after moving the boundary between them.

``KVCacheManager`` keeps reading ``coordinator.block_pool``; it is the token
pool, so usage, watermark and "free blocks" keep their upstream meaning for
the memory that grows with sequence length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
)
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.block_pool import InPlaceView
from vllm_hybrid.v1.core.pooled.boundary import Admission
from vllm_hybrid.v1.core.pooled.policy import (
    DECODE_EDGES,
    RELOCATE_NEAR_BOUNDARY,
    CheckpointPolicy,
    state_block_attention_tokens,
)
from vllm_hybrid.v1.core.pooled.retention import TurnEndRetentionMixin
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

logger = init_logger(__name__)


class PooledCoordinatorMixin:
    """Binds managers to arena pools and admits requests across both pools."""

    kv_cache_config: PooledKVCacheConfig
    single_type_managers: tuple[SingleTypeKVCacheManager, ...]

    def _bind_arena(self) -> None:
        # no encoder blocks in the arena (checked once: the managers are fixed)
        assert not any(
            isinstance(m, CrossAttentionManager) for m in self.single_type_managers
        )
        upstream_pool = self.block_pool  # built by upstream; only settings kept
        self.arena = KVArena(
            self.kv_cache_config.layout,
            enable_caching=upstream_pool.enable_caching,
            hash_block_size=upstream_pool.hash_block_size,
            enable_kv_cache_events=upstream_pool.enable_kv_cache_events,
            token_metrics_collector=upstream_pool.metrics_collector,
            break_even=state_block_attention_tokens(self.kv_cache_config),
        )
        self.pools = {
            PoolKind.TOKEN: self.arena.token_pool,
            PoolKind.STATE: self.arena.state_pool,
        }
        self._group_kind = [
            self.kv_cache_config.pool_of_group(i).kind
            for i in range(len(self.single_type_managers))
        ]
        # Upstream's managers hold the one pool their coordinator built;
        # point each at its arena pool (registry: INSTANCE_REWRITES).
        for manager, kind in zip(
            self.single_type_managers, self._group_kind, strict=True
        ):
            pool = self.pools[kind]
            manager.block_pool = pool
            manager._null_block = pool.null_block
        self.block_pool = self.arena.token_pool
        self._couple_prefix_caches()
        #: what admission reserved for a request's allocation when that
        #: differs from upstream's (a state advanced in place), until the
        #: allocation consumes it. Upstream's ``allocate_slots`` passes only a
        #: block count from one call to the other, so the value waits here,
        #: under its request: each admission replaces it, the allocation
        #: that follows it in ``allocate_slots`` takes it, and freeing the
        #: request drops one an allocation never came for.
        self._reserved: dict[str, Reservation] = {}
        #: how often a request crossed a state block edge in place: short of
        #: memory at an edge a policy keeps, or at an edge none keeps
        self.short_memory_counts = {"state_in_place": 0, "edges_in_place": 0}
        #: whether the arena refused the latest admission of a request that
        #: held no blocks (a waiting or preempted one)
        self._refusing_new = False
        #: running state blocks moved away from the boundary
        #: (:data:`~.policy.eviction.RELOCATE_NEAR_BOUNDARY`)
        self.relocations = 0
        #: token-pool blocks the scheduler keeps free for running requests'
        #: growth when it admits another (upstream's watermark, set per step)
        self.admission_reserve = 0
        if hasattr(self, "verify_and_split_kv_cache_groups"):
            self.verify_and_split_kv_cache_groups()

    def _couple_prefix_caches(self) -> None:
        """Coordinated eviction across the pools (:mod:`.coupling`), when
        prefix caching is on and the token pool's groups are full attention
        (a sliding window needs only its tail blocks for a hit)."""
        config = self.kv_cache_config
        if not (self.arena.token_pool.enable_caching and config.couple_prefix_caches):
            return
        token_groups: dict[int, int] = {}
        for group_id, kind in enumerate(self._group_kind):
            spec = config.kv_cache_groups[group_id].kv_cache_spec
            if kind is not PoolKind.TOKEN:
                continue
            if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
                return
            token_groups[group_id] = spec.block_size
        if token_groups and PoolKind.STATE in self._group_kind:
            self.arena.couple_prefix_caches(token_groups)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Token-pool blocks to allocate, after securing both pools.

        Admission (:meth:`_admit`) returns what it reserved. Upstream compares
        the returned count with the token pool's free blocks; an allocation
        the arena cannot serve returns one more than that, so upstream's
        "cannot allocate" path runs unchanged. Upstream passes only that count
        on to :meth:`allocate_new_blocks`, so a reservation that advances a
        state in place is kept for it under the request's id.
        """
        if self.retention_interval != 0:
            prefill_end = 0
        # a reservation answers the latest admission of its request only
        self._reserved.pop(request_id, None)
        needs = [
            manager.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks[i],
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                prefill_end=prefill_end,
            )
            for i, manager in enumerate(self.single_type_managers)
        ]
        reservation = self._admit(
            request_id, needs, new_computed_blocks, total_computed_tokens
        )
        if not self._holds_blocks(request_id):
            # a waiting or preempted request (admission takes no block yet)
            self._refusing_new = reservation is None
            self.arena.token_pool.clear_boundary(self._refusing_new)
        if reservation is None:
            # upstream's "cannot allocate": more than the token pool has free
            return self.block_pool.get_num_free_blocks() + 1
        if reservation.in_place:
            self._reserved[request_id] = reservation
        return reservation.token_blocks

    def free(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        super().free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._reserved.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def _admit(
        self,
        request_id: str,
        needs: list[int],
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        total_computed_tokens: int,
    ) -> Reservation | None:
        """What the arena secured for the request's new blocks (``needs``:
        per group), trying the growth reserve, then an edge nobody keeps
        advanced in place, then the ways of the boundary's admission; None
        when it cannot serve them."""
        need = {PoolKind.TOKEN: 0, PoolKind.STATE: 0}
        for kind, n in zip(self._group_kind, needs, strict=True):
            need[kind] += n
        need_token, need_state = need[PoolKind.TOKEN], need[PoolKind.STATE]
        # Prefix hits are touched only after this check; a boundary move must
        # not evict them or give their bytes to the other pool.
        hits = [block for blocks in new_computed_blocks for block in blocks]
        if self._admits_with_reserve(request_id, need_token, need_state, hits):
            return Reservation(need_token, need_state)
        in_place = self._in_place_blocks(request_id, needs)
        advanced = Reservation(need_token, need_state - len(in_place), in_place)
        unkept = bool(in_place) and self._unkept_edge(request_id, total_computed_tokens)
        if unkept and self._pins_boundary(in_place):
            # a fresh block away from the boundary (one copy) instead
            self.relocations += 1
        elif unkept:
            # an edge nobody keeps: advance in place, no copy
            admission = self.arena.boundary.admit(
                need_token, advanced.state_blocks, keep=hits
            )
            if admission is Admission.REFUSED:
                return None
            self.short_memory_counts["edges_in_place"] += 1
            return advanced
        admission = self.arena.boundary.admit(
            need_token, need_state, keep=hits, in_place=len(in_place)
        )
        if admission is Admission.REFUSED:
            return None
        if admission is Admission.IN_PLACE:
            self.short_memory_counts["state_in_place"] += 1
            return advanced
        return Reservation(need_token, need_state)

    def _admits_with_reserve(
        self,
        request_id: str,
        need_token: int,
        need_state: int,
        hits: list[KVCacheBlock],
    ) -> bool:
        """Admit a request that holds no blocks yet (waiting or preempted)
        with the growth reserve on top of its own token blocks.

        Upstream checks its watermark (:attr:`admission_reserve`, the
        scheduler's growth reserve) against the token pool's free blocks
        after this admission; securing only the request's own blocks would
        then refuse it while the state pool still holds free blocks the
        boundary could hand over. False (and nothing moved) when there is no
        reserve, the request already runs, or the arena cannot serve both.
        """
        if not self.admission_reserve or self._holds_blocks(request_id):
            return False
        admission = self.arena.boundary.admit(
            need_token + self.admission_reserve, need_state, keep=hits
        )
        return admission is Admission.SERVED

    def _holds_blocks(self, request_id: str) -> bool:
        return any(
            manager.req_to_blocks.get(request_id)
            for manager in self.single_type_managers
        )

    def _pins_boundary(self, in_place: Mapping[int, KVCacheBlock]) -> bool:
        """Whether a running state block the request would advance in place
        lies next to the boundary while new requests are refused
        (:data:`~.policy.eviction.RELOCATE_NEAR_BOUNDARY`): it then takes a fresh
        block, which the state pool hands out away from the boundary."""
        if not (self._refusing_new and RELOCATE_NEAR_BOUNDARY):
            return False
        near = self.arena.boundary.state_floor + RELOCATE_NEAR_BOUNDARY
        return any(block.block_id < near for block in in_place.values())

    # -- advancing the state in place ------------------------------------------

    def _unkept_edge(self, request_id: str, total_computed_tokens: int) -> bool:
        """Whether the request is crossing a state block edge that no
        checkpoint policy keeps (``keeps_edge`` of the retention mixin;
        without prefix caching there is none).

        The request has computed exactly ``total_computed_tokens``, an edge:
        its running block holds the state there. A fresh block would receive
        a copy of it and the block left behind would hold a state nobody
        caches: a decode edge before the turn end, or a prefill chunk that
        ended on no checkpoint.
        """
        keeps = getattr(self, "keeps_edge", None)
        if keeps is None:
            return False
        block = next(
            m.block_size
            for m, kind in zip(self.single_type_managers, self._group_kind, strict=True)
            if kind is PoolKind.STATE
        )
        if total_computed_tokens % block:
            return False
        return not keeps(request_id, total_computed_tokens, block)

    # -- short of memory: one state block per request -------------------------

    def _in_place_blocks(
        self, request_id: str, needs: list[int]
    ) -> dict[int, KVCacheBlock]:
        """Running state block per state group, if the request may advance its
        state in place: every state group needs exactly one new block (a state
        block edge) and owns its running block alone (every reference to it
        is one of the request's own slots, :func:`_own_slots`).

        At a state block edge align mode hands a running request a fresh
        state block, copies the running state into it and keeps the old block
        (a prefix-cache checkpoint) until the next step: two state blocks per
        request. When admission takes this way (see ``eviction.ADMISSION``),
        the request advances its state in the block it already owns instead
        (that block leaves the prefix cache, its content moves on). Only a
        checkpoint is lost; a lone request then needs one state block, as
        with prefix caching off.
        """
        found: dict[int, KVCacheBlock] = {}
        for i, manager in enumerate(self.single_type_managers):
            if self._group_kind[i] is not PoolKind.STATE:
                continue
            if (
                getattr(manager, "mamba_cache_mode", None) != "align"
                or manager.num_speculative_blocks
                or request_id not in manager._allocated_block_reqs
                or needs[i] != 1
            ):
                return {}
            blocks = manager.req_to_blocks.get(request_id) or []
            if not blocks or blocks[-1].is_null:
                return {}
            if blocks[-1].ref_cnt != _own_slots(blocks, manager, request_id):
                return {}
            found[i] = blocks[-1]
        return found

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Upstream's allocation, consuming what admission reserved: a state
        group that advances in place allocates from an :class:`InPlaceView`
        of its pool, which hands back the running block."""
        reservation = self._reserved.pop(request_id, None)
        if reservation is None:
            return super().allocate_new_blocks(
                request_id, num_tokens, num_tokens_main_model, num_encoder_tokens
            )
        out = []
        for i, manager in enumerate(self.single_type_managers):
            pool = manager.block_pool
            if i in reservation.in_place:
                manager.block_pool = InPlaceView(pool, reservation.in_place[i])
            try:
                out.append(
                    manager.allocate_new_blocks(
                        request_id, num_tokens, num_tokens_main_model
                    )
                )
            finally:
                manager.block_pool = pool
        return tuple(out)


@dataclass(frozen=True)
class Reservation:
    """What admission secured for one request's next allocation: free token
    and state blocks, and the running state block of each state group (by
    group index) that advances in place instead of taking a fresh one."""

    token_blocks: int
    state_blocks: int
    in_place: Mapping[int, KVCacheBlock] = field(default_factory=dict)


def _own_slots(
    blocks: list[KVCacheBlock], manager: SingleTypeKVCacheManager, request_id: str
) -> int:
    """Slots of the request's block table that name its running state block.

    Usually one. After the request advanced in place, the slot it advanced
    from names the same block until upstream retires it, which happens two
    steps later (the previous step may still be in flight); the block is
    then still the request's alone, with one reference per slot.
    """
    last = blocks[-1]
    retiring = getattr(manager, "last_state_block_idx", {}).get(request_id)
    if retiring is not None and retiring < len(blocks) - 1:
        return 2 if blocks[retiring] is last else 1
    return 1


def arena_of(kv_cache_manager: KVCacheManager) -> KVArena | None:
    """The arena behind a scheduler's KV cache manager (kept by the pooled
    coordinators); None with upstream's coordinators. The one way the
    scheduler's stats step and the benchmarks reach it."""
    return getattr(kv_cache_manager.coordinator, "arena", None)


class PooledHybridKVCacheCoordinator(
    PooledCoordinatorMixin, TurnEndRetentionMixin, HybridKVCacheCoordinator
):
    """Prefix caching on: upstream's hybrid coordinator over arena pools,
    keeping turn-end checkpoints (:mod:`vllm_hybrid.v1.core.pooled.retention`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Partial (sub-block) hits need copy-on-write block copies, which the
        # worker applies with one block count for every layer; pools differ.
        kwargs["allow_partial_hash_hits"] = False
        super().__init__(*args, **kwargs)
        self._bind_arena()
        config = self.kv_cache_config
        self._init_turn_ends(
            CheckpointPolicy.of(
                config.retain_turn_ends,
                config.prefill_checkpoint_interval,
                config.prefill_checkpoint_anchor,
                DECODE_EDGES,
            )
        )


class PooledNoPrefixCacheCoordinator(
    PooledCoordinatorMixin, KVCacheCoordinatorNoPrefixCache
):
    """Prefix caching off: upstream's no-cache coordinator over arena pools."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bind_arena()
