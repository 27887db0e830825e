"""Replacement of upstream's ``KVCacheManager.allocate_slots``: one
allocation path for pooled mode.

Upstream's ``allocate_slots`` counts the blocks an allocation needs
(``coordinator.get_num_blocks_to_allocate``), checks the count against the
free blocks of its one pool and then allocates
(``coordinator.allocate_new_blocks``); only the count passes from one call
to the next. Pooled mode's admission decides more than a count (where the
arena's boundary goes, which live token blocks move out of its way, whether
a running request advances its state in place), so over a pooled
coordinator the same sequence runs with the admission as a value: the
coordinator's :meth:`~vllm_hybrid.v1.core.pooled.coordinator.
PooledCoordinatorMixin.admit` decides without changing anything, a refusal
returns None as upstream's failed check does, and
:meth:`~vllm_hybrid.v1.core.pooled.coordinator.PooledCoordinatorMixin.allocate`
carries out exactly what was decided. Every other coordinator runs
upstream's method unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.coordinator import PooledCoordinatorMixin

#: Request states the watermark (the pooled scheduler's growth reserve)
#: applies to, as upstream applies it.
_NEW = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def allocate_slots(
    self: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: KVCacheBlocks | None = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
    full_sequence_must_fit: bool = False,
    reserved_blocks: int = 0,
    has_scheduled_reqs: bool = True,
    skip_zeroing_group_ids: tuple[int, ...] = (),
) -> KVCacheBlocks | None:
    """Upstream's ``allocate_slots``; over a pooled coordinator, the same
    steps with the arena's admission decided once and carried out (module
    docstring)."""
    coordinator = self.coordinator
    if not isinstance(coordinator, PooledCoordinatorMixin):
        return upstream_of(__name__, "allocate_slots")(
            self,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )
    if not (num_new_tokens or num_external_computed_tokens or num_new_computed_tokens):
        raise ValueError(
            "num_new_tokens must be greater than 0 when there are no "
            "computed tokens to adopt"
        )
    hits = _hits(
        self,
        new_computed_blocks,
        num_new_computed_tokens + num_external_computed_tokens,
    )
    local = request.num_computed_tokens + num_new_computed_tokens
    computed = local + num_external_computed_tokens
    total = min(computed, self.max_model_len)
    # upstream keeps its watermark free for running requests when it admits
    # a waiting or preempted one, and ``reserved_blocks`` for others' loads
    # a waiting or preempted request that computed nothing holds no blocks
    new = request.status in _NEW and not request.num_computed_tokens
    reserve = reserved_blocks + (
        self.watermark_blocks if new and has_scheduled_reqs else 0
    )
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if full_sequence_must_fit:
        full = min(request.num_tokens, self.max_model_len)
        fits = coordinator.admit(
            request.request_id,
            full,
            hits,
            num_encoder_tokens,
            total,
            local,
            full,
            apply_admission_cap=True,
            prefill_end=prefill_end,
            reserve=reserve,
        )
        if fits is None:
            if new:
                coordinator.arena.note_new_request(admitted=False)
            return None
    main_model = total + num_new_tokens
    need_slot = min(main_model + num_lookahead_tokens, self.max_model_len)
    coordinator.remove_skipped_blocks(
        request.request_id,
        max(0, total - request.num_in_flight_tokens),
        num_prompt_tokens=request.num_prompt_tokens,
    )
    admission = coordinator.admit(
        request.request_id,
        need_slot,
        hits,
        num_encoder_tokens,
        computed,
        local,
        main_model,
        prefill_end=prefill_end,
        reserve=reserve,
    )
    if new:
        coordinator.arena.note_new_request(admitted=admission is not None)
    if admission is None:
        return None
    if new:
        # the requests admitted after this one in the step keep room for
        # its growth too (the scheduler sets the watermark at the step's
        # start from the requests running then)
        self.watermark_blocks += coordinator.admitter.growth_of(request, main_model)
    if hits is not self.empty_kv_cache_blocks.blocks or num_external_computed_tokens:
        coordinator.allocate_new_computed_blocks(
            request_id=request.request_id,
            new_computed_blocks=hits,
            num_local_computed_tokens=local,
            num_external_computed_tokens=num_external_computed_tokens,
            skip_zeroing_group_ids=skip_zeroing_group_ids,
        )
    new_blocks = coordinator.allocate(
        admission, request.request_id, need_slot, main_model, num_encoder_tokens
    )
    if not delay_cache_blocks:
        # only finalized tokens are cached (not draft tokens that may be
        # rejected), as upstream
        cached = min(total + num_new_tokens, request.num_tokens)
        coordinator.cache_blocks(request, cached)
    return self.create_kv_cache_blocks(new_blocks)


def _hits(
    manager: KVCacheManager,
    new_computed_blocks: KVCacheBlocks | None,
    reused_tokens: int,
) -> tuple[Sequence[KVCacheBlock], ...]:
    """The prefix hits per group, as upstream keeps them: only the prefix the
    local and external hits cover in the groups that retain hit blocks."""
    if new_computed_blocks is None:
        return manager.empty_kv_cache_blocks.blocks
    blocks = new_computed_blocks.blocks
    if not manager.retained_hit_group_ids:
        return blocks
    groups = list(blocks)
    for group_id in manager.retained_hit_group_ids:
        size = manager.coordinator.single_type_managers[group_id].block_size
        groups[group_id] = groups[group_id][: -(-reused_tokens // size)]
    return tuple(groups)
