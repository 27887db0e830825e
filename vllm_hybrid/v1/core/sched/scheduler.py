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
alignment the state group's block instead, and also ends a chunk at each
prefill checkpoint (:mod:`vllm_hybrid.v1.core.pooled.prefill_checkpoints`);
everything else stays upstream's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.stats import SchedulerStats

from vllm_hybrid import envs
from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.coordinator import arena_of
from vllm_hybrid.v1.core.pooled.eviction import (
    ADMISSION_GROWTH_STATE_PAGES,
    DECODE_ROOM,
    PACING_MAX_WAITING,
    PACING_MIN_PAGES,
    PREFILL_PACING,
    PrefillPacing,
)
from vllm_hybrid.v1.core.pooled.prefill_checkpoints import (
    last_prefill_checkpoint,
    next_prefill_checkpoint,
    prompt_checkpoint,
    state_page_tokens,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind
from vllm_hybrid.v1.core.pooled.usage import usage_publisher

logger = init_logger(__name__)


def state_checkpoint_block(
    kv_cache_config: KVCacheConfig, mamba_cache_mode: str
) -> int | None:
    """The state block prefill chunks must end on, when it is longer than the
    attention block; None otherwise (upstream's alignment is then right).

    Only align mode writes checkpoints; all state groups of a pooled plan
    share one block size (the checkpoint interval).
    """
    if mamba_cache_mode != "align":
        return None
    state, token = set(), set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        (state if isinstance(spec, MambaSpec) else token).add(spec.block_size)
    if len(state) != 1 or not token:
        return None
    (block,) = state
    return block if block > min(token) else None


class PooledSchedulerMixin:
    """What a pooled engine's scheduler adds to upstream's.

    * Align-mode prefill chunks end on state checkpoint edges. Upstream's
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
      eviction.PrefillPacing`). Where the checkpoints lie on page multiples,
      such a step keeps those its chunks end on instead of cutting chunks
      for each; a chunk reaching the prompt's own checkpoint still stops at
      the last one before it.
    * A running request's prefill chunk that the token budget cuts leaves
      room for the decodes of the running requests after it
      (:data:`~vllm_hybrid.v1.core.pooled.eviction.DECODE_ROOM`).
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
        #: it and of paced steps (None: never paced), and whether this step is
        self._pace_page = pacing_page(
            self.kv_cache_config, self.cache_config.mamba_cache_mode
        )
        self._full_budget = self.max_num_scheduled_tokens
        self._paced_budget = paced_step_budget(
            self._full_budget, self._pace_page, prefill_pacing_policy()
        )
        self._paced_step = False
        #: decode tokens of the running requests after each prefilling one,
        #: this step (empty: no room kept)
        self._decode_room: dict[str, int] = {}
        #: prefill checkpoints lie on page multiples, where paced chunks end
        self._checkpoints_on_pace = bool(
            self._pace_page and self.prefill_checkpoint_interval % self._pace_page == 0
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
        """Upstream's split, ending the chunk at the next prefill checkpoint
        when it would run past one; in a paced step, of the chunk paced."""
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        room = self._decode_room.get(request.request_id, 0)
        if room and start + num_new_tokens < prefill_end(request):
            # the budget cut this chunk: what it leaves, the decodes behind get
            num_new_tokens = max(num_new_tokens - room, 0)
            if num_new_tokens == 0:
                return 0
        if self._paced_step:
            # before upstream's split, so that the stops it adds (the
            # prompt's own checkpoint, a junction) stay where they are
            num_new_tokens = self._paced_chunk(request, start, num_new_tokens)
            if num_new_tokens == 0:
                return 0
        num_new_tokens = super()._mamba_block_aligned_split(
            request,
            num_new_tokens,
            num_new_local_computed_tokens,
            num_external_computed_tokens,
        )
        if self._paced_step and self._checkpoints_on_pace:
            return self._paced_checkpoint_stop(request, start, num_new_tokens)
        stop = next_prefill_checkpoint(
            start,
            request.num_prompt_tokens,
            self.prefill_checkpoint_interval,
            self.cache_config.block_size,
        )
        if stop is not None and stop < start + num_new_tokens:
            self.prefill_checkpoint_cuts += 1
            return stop - start
        return num_new_tokens

    def _paced_checkpoint_stop(
        self, request: Request, start: int, num_new_tokens: int
    ) -> int:
        """A paced chunk ends on a page multiple, where a prefill checkpoint
        is kept without cutting the chunk short for it; only a chunk that
        reaches the prompt's own checkpoint stops at the last prefill
        checkpoint before it, as upstream's split stops at its last block
        edge, so a first reuse of the prefix finds it."""
        block = self.cache_config.block_size
        end = start + num_new_tokens
        if end < prompt_checkpoint(request.num_prompt_tokens, block):
            return num_new_tokens
        stop = last_prefill_checkpoint(
            start,
            end,
            request.num_prompt_tokens,
            self.prefill_checkpoint_interval,
            block,
        )
        if stop is None:
            return num_new_tokens
        self.prefill_checkpoint_cuts += 1
        return stop - start

    def _paced_chunk(self, request: Request, start: int, num_new_tokens: int) -> int:
        """The chunk a paced step's budget allows, ended on a multiple of the
        pacing page unless it finishes the prompt (as upstream's align split
        ends it on its block); 0 when no multiple lies inside it."""
        assert self._pace_page is not None
        end = start + num_new_tokens
        if end >= prefill_end(request):
            return num_new_tokens
        return max(end // self._pace_page * self._pace_page - start, 0)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._paced_step = self.paces_next_step()
        self.max_num_scheduled_tokens = (
            self._paced_budget if self._paced_step else self._full_budget
        )
        self._decode_room = decode_room(self.running) if DECODE_ROOM else {}
        if self._growth is not None:
            # upstream's watermark: free token blocks a waiting or preempted
            # request must leave after its own, while others run
            reserve = self.growth_reserve()
            self.kv_cache_manager.watermark_blocks = reserve
            coordinator = self.kv_cache_manager.coordinator
            if hasattr(coordinator, "admission_reserve"):
                # so that admission moves the arena's boundary for it too
                coordinator.admission_reserve = reserve
        return super().schedule(*args, **kwargs)

    def paces_next_step(self) -> bool:
        """Whether the next step is paced: pacing is on for this plan and at
        most :data:`~vllm_hybrid.v1.core.pooled.eviction.PACING_MAX_WAITING`
        requests wait."""
        return (
            self._paced_budget is not None and len(self.waiting) <= PACING_MAX_WAITING
        )

    def growth_reserve(self) -> int:
        """Token-pool blocks the running requests may grow into before a
        waiting request is admitted: each running request's next
        ``horizon`` tokens, or what its token budget has left if less."""
        assert self._growth is not None
        horizon, block, groups = self._growth
        blocks = 0
        for request in self.running:
            end = request.num_prompt_tokens + request.max_tokens - 1
            grow = min(end - request.num_computed_tokens, horizon)
            if grow > 0:
                blocks += cdiv(grow, block)
        return blocks * groups

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        stats = super().make_stats(*args, **kwargs)
        arena = arena_of(self.kv_cache_manager)
        publish = self._publish_usage
        if stats is not None and arena is not None and publish is not None:
            publish(arena.usage())
        return stats


def prefill_end(request: Request) -> int:
    """The position a request's prefill ends at: its prompt, or for a
    resumed request the output tokens it replays, as upstream's split."""
    return max(request.num_prompt_tokens, request.num_tokens - 1)


def decode_room(running: list[Request]) -> dict[str, int]:
    """For each prefilling request in ``running``, the tokens the decoding
    requests after it schedule this step (one each, plus its draft tokens);
    prefilling requests without decodes after them are left out."""
    room: dict[str, int] = {}
    behind = 0
    for request in reversed(running):
        if request.num_computed_tokens < prefill_end(request):
            if behind:
                room[request.request_id] = behind
            continue
        behind += 1 + len(request.spec_token_ids)
    return room


def growth_reserve_geometry(
    kv_cache_config: KVCacheConfig,
) -> tuple[int, int, int] | None:
    """(horizon in tokens, token block, token groups) of admission's growth
    reserve for a pooled plan with a state pool; None otherwise or when
    :data:`~vllm_hybrid.v1.core.pooled.eviction.ADMISSION_GROWTH_STATE_PAGES`
    is 0."""
    if not isinstance(kv_cache_config, PooledKVCacheConfig):
        return None
    pages = admission_growth_state_pages()
    if pages <= 0 or not any(p.kind is PoolKind.STATE for p in kv_cache_config.pools):
        return None
    token = kv_cache_config.pool_by_kind(PoolKind.TOKEN)
    block = kv_cache_config.kv_cache_groups[token.group_ids[0]].kv_cache_spec
    horizon = int(pages * state_page_tokens(kv_cache_config))
    return horizon, block.block_size, len(token.group_ids)


def pacing_page(kv_cache_config: KVCacheConfig, mamba_cache_mode: str) -> int | None:
    """The page pooled mode paces steps on: the state page in tokens
    (upstream's state block), rounded up to the state block; None outside
    align mode or for a plan without a state pool."""
    if mamba_cache_mode != "align" or not isinstance(
        kv_cache_config, PooledKVCacheConfig
    ):
        return None
    if not any(p.kind is PoolKind.STATE for p in kv_cache_config.pools):
        return None
    state = kv_cache_config.pool_by_kind(PoolKind.STATE)
    block = kv_cache_config.kv_cache_groups[state.group_ids[0]].kv_cache_spec.block_size
    return cdiv(state_page_tokens(kv_cache_config), block) * block


def paced_step_budget(
    budget: int, page: int | None, pacing: PrefillPacing
) -> int | None:
    """The token budget of a paced step: the largest multiple of ``page``
    within ``budget``; None when steps are never paced (``FILL``, no page,
    or a budget of fewer than
    :data:`~vllm_hybrid.v1.core.pooled.eviction.PACING_MIN_PAGES` pages)."""
    if pacing is PrefillPacing.FILL or page is None:
        return None
    pages = budget // page
    return pages * page if pages >= PACING_MIN_PAGES else None


def prefill_pacing_policy(environ: dict[str, str] | None = None) -> PrefillPacing:
    """``VLLM_HYBRID_PREFILL_PACING`` when set, else
    :data:`~vllm_hybrid.v1.core.pooled.eviction.PREFILL_PACING`."""
    return envs.choice(envs.PREFILL_PACING_VAR, PREFILL_PACING, environ)


def admission_growth_state_pages(environ: dict[str, str] | None = None) -> float:
    """``VLLM_HYBRID_ADMISSION_GROWTH`` when set, else
    :data:`~vllm_hybrid.v1.core.pooled.eviction.ADMISSION_GROWTH_STATE_PAGES`."""
    value = envs.raw(envs.ADMISSION_GROWTH_VAR, environ)
    if value is None:
        return ADMISSION_GROWTH_STATE_PAGES
    try:
        pages = float(value)
    except ValueError:
        pages = -1.0
    if pages < 0:
        raise ValueError(
            f"{envs.ADMISSION_GROWTH_VAR}={value!r} is not understood: state "
            "pages of growth to reserve, a number >= 0"
        )
    return pages


class PooledScheduler(PooledSchedulerMixin, Scheduler):
    """Upstream's ``Scheduler`` for pooled plans (see the mixin)."""
