"""Scheduler of pooled mode: per-pool usage each step, checkpoint-aligned chunks.

Every pooled engine's scheduler hands the arena's per-pool usage once per
step, from its stats path (``make_stats``), to the publisher the metrics side
installed (:mod:`vllm_hybrid.v1.core.pooled.usage`), for the frontend's
``/metrics``.

In align mode vLLM's scheduler ends every prefill chunk on a "block" edge,
because a Mamba/GDN state is written to its block only at chunk ends: block
``p`` must hold the state after exactly ``(p + 1) * block`` tokens. The
scheduler takes that block from ``cache_config.block_size``, which upstream
always makes equal to the state block (it inflates attention to it).

Pooled mode keeps attention at its natural block and lets the state
checkpoint interval (``--mamba-block-size``) be a multiple of it. Then
``cache_config.block_size`` is the attention block, chunks end on attention
block edges, and every checkpoint a chunk runs past is never written: with
an interval of 384 over 128-token attention blocks a 760-token prompt was
cut at 640 and cached no state at 384. This scheduler gives the Mamba
alignment the state group's block instead. Where else a chunk ends (prefill
checkpoints, paced steps, room for decodes, deep chunks) is the checkpoint
policy's decision (:mod:`vllm_hybrid.v1.core.pooled.policy`); the scheduler
holds the step's state the policy reads. Everything else stays upstream's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.stats import SchedulerStats

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.coordinator import arena_of
from vllm_hybrid.v1.core.pooled.moves import MOVES_ATTRIBUTE, new_block_ids_follow
from vllm_hybrid.v1.core.pooled.policy.eviction import Entry
from vllm_hybrid.v1.core.pooled.policy.positions import (
    keeps_a_turn_end_past_prompt,
    prompt_checkpoint,
)
from vllm_hybrid.v1.core.pooled.policy.steps import (
    DECODE_ROOM,
    StepPlan,
    admits_after_deep_cut,
    budget_chunk,
    checkpoint_chunk,
    checkpoints_on_pace,
    cuts_deep_chunks,
    decode_room,
    deep_chunk,
    deep_chunk_start,
    growth_reserve_blocks,
    growth_reserve_geometry,
    junction_stop,
    junction_worth_a_step,
    keeps_last_checkpoint,
    keeps_prompt_checkpoint,
    paced_step_budget,
    paces,
    pacing_page,
    prefill_end,
    state_checkpoint_block,
)
from vllm_hybrid.v1.core.pooled.usage import usage_publisher

logger = init_logger(__name__)


class PooledSchedulerMixin:
    """What a pooled engine's scheduler adds to upstream's.

    * Align-mode prefill chunks end on state checkpoint edges (the policy's
      ``state_checkpoint_block``). Upstream's
      ``Scheduler`` reads ``cache_config.block_size`` after its constructor
      only in ``_mamba_block_aligned_split`` (a test checks this against the
      installed vLLM), so the scheduler keeps its own copy of the cache config
      whose ``block_size`` is the state block; the workers' config, and with
      it the attention block, is untouched.
    * A prefill chunk also ends at each prefill checkpoint, so the state
      there is written and retention can keep it.
    * While few requests wait, a step computes at most upstream's chunk of
      one long prompt, and a chunk that does not finish its prompt ends on a
      multiple of the state page (:class:`~vllm_hybrid.v1.core.pooled.
      policy.steps.PrefillPacing`). Where the checkpoints lie on page multiples,
      such a step keeps those its chunks end on instead of cutting chunks
      for each; a chunk reaching the prompt's own checkpoint also stops at
      the last one before it unless prompts' own served more hits lately.
    * A stop upstream's split makes at a shared-prefix junction one block
      past the chunk's start is dropped: it would cost the prompt a step to
      save a sibling one block (:func:`~vllm_hybrid.v1.core.pooled.policy.
      steps.junction_worth_a_step`).
    * A running request's prefill chunk that the token budget cuts leaves
      room for the decodes of the running requests after it
      (:data:`~vllm_hybrid.v1.core.pooled.policy.steps.DECODE_ROOM`).
    * A running request's prefill chunk that the arena cannot serve waits
      for a later step while another running request decodes, instead of
      upstream preempting a request for it.
    * Per-pool usage goes to the installed publisher once per step, after
      upstream's stats.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        parallel = self.vllm_config.parallel_config
        #: where each step's pool usage goes (None: nowhere)
        self._publish_usage = usage_publisher(
            int(getattr(parallel, "data_parallel_index", 0) or 0)
        )
        #: tokens between prefill checkpoints (0: none)
        self.prefill_checkpoint_interval = getattr(
            self.kv_cache_config, "prefill_checkpoint_interval", 0
        )
        #: prefill chunks this scheduler cut short at a prefill checkpoint
        self.prefill_checkpoint_cuts = 0
        #: (tokens each running request may grow, token block, token groups)
        #: of admission's growth reserve; None: no reserve
        self._growth = growth_reserve_geometry(self.kv_cache_config)
        #: the page paced chunks end on, the token budget of steps that fill
        #: it and of paced steps (None: never paced)
        self._pace_page = pacing_page(
            self.kv_cache_config, self.cache_config.mamba_cache_mode
        )
        self._full_budget = self.max_num_scheduled_tokens
        self._paced_budget = paced_step_budget(self._full_budget, self._pace_page)
        #: the prompt position from which unfinished chunks end on the next
        #: page (0: never)
        self._deep_chunk = deep_chunk_start(self._pace_page, self._full_budget)
        #: what this step's chunks follow (a new one at each step's start)
        self._step = StepPlan()
        self._allow_token_moves()
        #: prefill checkpoints lie on page multiples, where paced chunks end
        self._checkpoints_on_pace = checkpoints_on_pace(
            self.prefill_checkpoint_interval, self._pace_page
        )
        if self.prefill_checkpoint_interval:
            anchor = getattr(self.kv_cache_config, "prefill_checkpoint_anchor", 0)
            logger.info(
                "vllm-hybrid pooled KV mode: prefill checkpoints every %d tokens%s",
                self.prefill_checkpoint_interval,
                f", kept in LRU order every {anchor}" if anchor else "",
            )
        block = state_checkpoint_block(
            self.kv_cache_config, self.cache_config.mamba_cache_mode
        )
        if block is None:
            return
        attention_block = self.cache_config.block_size
        view = copy.copy(self.cache_config)
        view.block_size = block
        self.cache_config = view
        logger.info(
            "vllm-hybrid pooled KV mode: prefill chunks end on state checkpoint "
            "edges (every %d tokens; attention blocks of %d)",
            block,
            attention_block,
        )

    def _mamba_block_aligned_split(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """Upstream's split of the chunk the policy's budget allows, ended
        where a prefill checkpoint needs its state
        (:mod:`~vllm_hybrid.v1.core.pooled.policy` cuts)."""
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        if start >= prefill_end(request):
            # decoding (most calls): upstream's split leaves it whole too
            return num_new_tokens
        step = self._step
        chunk = budget_chunk(
            request,
            start,
            num_new_tokens,
            step.decode_room.get(request.request_id, 0),
            self._pace_page if step.paced else None,
        )
        if chunk is None:
            return 0
        if step.deep:
            chunk = self._deep_cut(request, start, chunk)
            if chunk == 0:
                return 0
        aligned = self._upstream_split(
            request,
            start,
            chunk,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        cut = checkpoint_chunk(
            request,
            start,
            aligned,
            self.prefill_checkpoint_interval,
            self.cache_config.block_size,
            step.paced and self._checkpoints_on_pace,
            step.keep_last,
        )
        if cut != aligned:
            self.prefill_checkpoint_cuts += 1
        if request.status == RequestStatus.RUNNING and self._waits_for_room(
            request, cut
        ):
            return 0
        return cut

    def _waits_for_room(self, request: Request, chunk: int) -> bool:
        """Whether a running request's prefill ``chunk`` waits for a later
        step: the arena cannot serve it now and another running request
        decodes, so the step makes progress without it. Upstream would
        preempt a request (often this one, losing its computed tokens) to
        serve the chunk at once; admission keeps the waiting chunk's growth
        from new requests."""
        if not chunk:
            return False
        manager = self.kv_cache_manager
        coordinator, limit = manager.coordinator, manager.max_model_len
        computed = request.num_computed_tokens
        main_model = min(computed, limit) + chunk
        # the count upstream's allocation makes for it (no prefix hit); it
        # leaves out the blocks the allocation frees first (skipped ones)
        admission = coordinator.admit(
            request.request_id,
            min(main_model + self.num_lookahead_tokens, limit),
            manager.empty_kv_cache_blocks.blocks,
            0,
            computed,
            computed,
            main_model,
            prefill_end=prefill_end(request),
        )
        if admission is not None:
            return False
        return any(
            other.num_computed_tokens >= prefill_end(other)
            for other in self.running
            if other is not request
        )

    def _upstream_split(
        self, request: Request, start: int, chunk: int, local: int, external: int
    ) -> int:
        """Upstream's split of ``chunk``, less a stop at a shared-prefix
        junction that is not worth a step (:func:`junction_worth_a_step`) and
        the stop at the prompt's own checkpoint in a step that does not keep
        it (:func:`keeps_prompt_checkpoint`) for a request whose decoding
        keeps a turn end past it (:func:`keeps_a_turn_end_past_prompt`)."""
        aligned = super()._mamba_block_aligned_split(request, chunk, local, external)
        block = self.cache_config.block_size
        if (
            not self._step.keep_prompt
            and aligned < chunk
            and start + chunk >= prefill_end(request)
            and start + aligned == prompt_checkpoint(request.num_tokens, block)
            and keeps_a_turn_end_past_prompt(request, block)
        ):
            return chunk
        junction = request.shared_prefix_boundary
        if (
            not junction
            or aligned >= chunk
            or start + aligned != junction_stop(start, junction, block)
            or junction_worth_a_step(start, junction, block)
        ):
            return aligned
        request.shared_prefix_boundary = 0
        try:
            return super()._mamba_block_aligned_split(request, chunk, local, external)
        finally:
            request.shared_prefix_boundary = junction

    def _deep_cut(self, request: Request, start: int, chunk: int) -> int:
        """The chunk after the deep-chunk rule: ended on the next page deep
        in a prompt; nothing for a waiting prompt a step that cut one does
        not admit (:func:`admits_after_deep_cut`)."""
        page = self._pace_page
        assert page is not None
        if self._step.cut_deep and request.status != RequestStatus.RUNNING:
            budget = self._full_budget
            return (
                chunk
                if admits_after_deep_cut(request, start, chunk, page, budget)
                else 0
            )
        cut = deep_chunk(request, start, chunk, page, self._deep_chunk)
        if cut < chunk:
            self._step.cut_deep = True
        return cut

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        paced = self.paces_next_step()
        hits = self._rival_hits()
        self._step = StepPlan(
            paced=paced,
            deep=bool(self._deep_chunk) and cuts_deep_chunks(len(self.waiting)),
            decode_room=decode_room(self.running) if DECODE_ROOM else {},
            keep_last=paced and keeps_last_checkpoint(hits),
            keep_prompt=keeps_prompt_checkpoint(hits),
        )
        self.max_num_scheduled_tokens = (
            self._paced_budget if paced else self._full_budget
        )
        if self._growth is not None:
            # upstream's watermark: free token blocks a waiting or preempted
            # request must leave after its own, while others run (the
            # arena's admission moves the boundary for them too)
            # (only a waiting request reads it, and none arrives mid-step)
            self.kv_cache_manager.watermark_blocks = (
                self.growth_reserve() if self.waiting else 0
            )
        output = super().schedule(*args, **kwargs)
        arena = arena_of(self.kv_cache_manager)
        moves = arena.take_token_moves() if arena is not None else None
        if moves:
            # the workers copy the moved blocks and rename them in the block
            # tables they keep before they run the step
            setattr(output, MOVES_ATTRIBUTE, moves)
        return output

    def _allow_token_moves(self) -> None:
        """Let the arena move live token blocks off its boundary
        (:mod:`~vllm_hybrid.v1.core.pooled.moves`), unless a KV connector
        may read blocks by id across steps or ``hybrid_kv.token_moves`` is
        off."""
        arena = arena_of(self.kv_cache_manager)
        if arena is None or self.connector is not None:
            return
        if not getattr(self.kv_cache_config, "token_moves", True):
            return
        managers = [
            manager
            for manager in self.kv_cache_manager.coordinator.single_type_managers
            if manager.block_pool is arena.token_pool
        ]
        arena.allow_token_moves(new_block_ids_follow(managers))

    def _rival_hits(self) -> Mapping[Entry, float]:
        """The state pool's recent prefix hits per counted kind (none
        without an arena)."""
        arena = arena_of(self.kv_cache_manager)
        if arena is None:
            return {}
        return arena.state_pool.free_block_queue.policy.rival_hits

    def paces_next_step(self) -> bool:
        """Whether the next step is paced: pacing is on for this plan and at
        most :data:`~vllm_hybrid.v1.core.pooled.policy.steps.PACING_MAX_WAITING`
        requests wait."""
        return paces(len(self.waiting), self._paced_budget)

    def growth_reserve(self) -> int:
        """Token-pool blocks the running requests may grow into before a
        waiting request is admitted: each running request's next
        ``horizon`` tokens, or what its token budget has left if less."""
        assert self._growth is not None
        return growth_reserve_blocks(self.running, self._growth)

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        stats = super().make_stats(*args, **kwargs)
        arena = arena_of(self.kv_cache_manager)
        publish = self._publish_usage
        if stats is not None and arena is not None and publish is not None:
            publish(arena.usage())
        return stats


class PooledScheduler(PooledSchedulerMixin, Scheduler):
    """Upstream's ``Scheduler`` for pooled plans (see the mixin)."""
