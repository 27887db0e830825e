"""What one scheduler step computes and admits: where prefill chunks end,
how many prompt tokens a step takes, room for decodes, admission's reserve.

The chunk cut (:func:`budget_chunk`, :func:`checkpoint_chunk`): a chunk ends
at the next prefill checkpoint it would run past (:mod:`.positions`); a paced
step (:data:`PACING_MAX_WAITING`) ends chunks on state page multiples and keeps
the checkpoints there without extra cuts; a chunk the token budget cut
leaves room for the decodes behind it (:data:`DECODE_ROOM`); a chunk deep
in a long prompt ends on the next state page (:data:`DEEP_CHUNK_TOKENS`). A
waiting request is admitted only while the running ones keep room to grow
(:func:`growth_reserve_blocks`). The scheduler holds the step's state and asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from vllm_hybrid.v1.core.pooled.policy.positions import (
    last_prefill_checkpoint,
    next_prefill_checkpoint,
    prompt_checkpoint,
    state_page_tokens,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.v1.request import Request


#: Prefill pacing: every running request's next token waits for the step,
#: so the decode tail follows the prompt tokens of the steps decodes share.
#: Upstream's align mode ends an unfinished chunk on its 1,056-2,768-token
#: state block; pooled mode's state block is the attention block, so its
#: steps would fill the whole token budget. While at most this many requests
#: wait, a step's token budget is instead the largest multiple of the state
#: page (upstream's block, in tokens) it holds and an unfinished chunk ends on
#: a multiple of the page, as upstream's split ends it on its block; with
#: more waiting, queueing dominates and steps fill the budget
#: (docs/pooled-mode.md, "Prefill pacing").
PACING_MAX_WAITING = 4

#: State pages a step's token budget must hold for steps to be paced. A
#: budget of one page and a bit (2,048 tokens below 70 GiB against bf16's
#: 1,056-token page) would be nearly halved: steps of ~1,000 prompt tokens
#: are bound by reading the weights, so twice as many of them lengthened the
#: decode tail instead of shortening it (the simulator at 24 and 48 GB bf16).
PACING_MIN_PAGES = 2

#: Whether a running request's prefill chunk leaves room in the step's token
#: budget for the decodes of the running requests after it: vLLM schedules
#: running requests in order, so a long prompt admitted earlier would starve
#: the decodes of shorter ones after it, which upstream's align split (its
#: chunk ends on a 1,056-2,768-token block) leaves room for
#: (docs/pooled-mode.md, "Room for the decodes behind a long prompt").
DECODE_ROOM = True

#: Prompt position (tokens) from which an unfinished prefill chunk ends on
#: the next multiple of the state page in tokens (at most one page), as
#: upstream's align split ends it on its 1,056-2,768-token block; where the
#: token budget holds a page, a step that cut one admits no waiting prompt
#: that would not finish in it (upstream's split cuts such a prompt's first
#: chunk to nothing there and stops admitting). A chunk's attention work
#: grows with its position: deep in a long prompt a step filled with prompt
#: tokens by pooled mode's 16-token blocks took up to 1.6x upstream's longest
#: step, and every decode sharing it waited. Shallower chunks keep the whole
#: budget. Where it applies: :func:`deep_chunk_start` and
#: :func:`cuts_deep_chunks`.
DEEP_CHUNK_TOKENS = 4096

#: Admission's growth reserve, in state pages of tokens (the block upstream's
#: single pool inflates attention to; 0 turns the reserve off). A waiting
#: request is admitted only while the token pool keeps, beyond its blocks,
#: room for every running request to grow that many tokens (or to its token
#: budget, if nearer), as upstream's large block does implicitly (see
#: ``PooledSchedulerMixin``).
ADMISSION_GROWTH_STATE_PAGES = 1.0


@dataclass
class StepPlan:
    """What one scheduler step's prefill chunks follow, decided at its start
    (:meth:`~vllm_hybrid.v1.core.sched.scheduler.PooledSchedulerMixin.schedule`
    makes a new one each step), and whether the step cut a deep chunk yet."""

    #: the step's token budget is paced (:func:`paces`)
    paced: bool = False
    #: the step cuts chunks deep in a prompt (:func:`cuts_deep_chunks`)
    deep: bool = False
    #: decode tokens of the running requests after each prefilling one
    #: (:func:`decode_room`; empty: no room kept)
    decode_room: Mapping[str, int] = field(default_factory=dict)
    #: a chunk of this step was cut deep in its prompt
    cut_deep: bool = False


# -- the chunk cut ---------------------------------------------------------------


def state_checkpoint_block(
    kv_cache_config: KVCacheConfig, mamba_cache_mode: str
) -> int | None:
    """The state block prefill chunks must end on (align mode), when longer
    than the attention block; None otherwise (upstream's alignment is right).
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


def pacing_page(kv_cache_config: KVCacheConfig, mamba_cache_mode: str) -> int | None:
    """The page paced steps end chunks on: the state page in tokens, rounded
    up to the state block; None outside align mode or without a state pool."""
    if mamba_cache_mode != "align" or not isinstance(
        kv_cache_config, PooledKVCacheConfig
    ):
        return None
    if not any(p.kind is PoolKind.STATE for p in kv_cache_config.pools):
        return None
    state = kv_cache_config.pool_by_kind(PoolKind.STATE)
    block = kv_cache_config.kv_cache_groups[state.group_ids[0]].kv_cache_spec.block_size
    return cdiv(state_page_tokens(kv_cache_config), block) * block


def paced_step_budget(budget: int, page: int | None) -> int | None:
    """The token budget of a paced step: the largest multiple of ``page``
    within ``budget``; None when steps are never paced (no page, or a budget
    under :data:`PACING_MIN_PAGES` pages)."""
    if page is None:
        return None
    pages = budget // page
    return pages * page if pages >= PACING_MIN_PAGES else None


def paces(num_waiting: int, paced_budget: int | None) -> bool:
    """Whether a step is paced: pacing is on for the plan (a paced budget)
    and at most :data:`PACING_MAX_WAITING` requests wait."""
    return paced_budget is not None and num_waiting <= PACING_MAX_WAITING


def checkpoints_on_pace(interval: int, page: int | None) -> bool:
    """Whether prefill checkpoints lie on the page multiples paced chunks
    end on anyway."""
    return bool(page and interval % page == 0)


def prefill_end(request: Request) -> int:
    """The position a request's prefill ends at: its prompt, or for a
    resumed request the output tokens it replays, as upstream's split."""
    return max(request.num_prompt_tokens, request.num_tokens - 1)


def decode_room(running: list[Request]) -> dict[str, int]:
    """Per prefilling request in ``running`` with decodes after it, the
    tokens those schedule this step (one each, plus draft tokens)."""
    room: dict[str, int] = {}
    behind = 0
    for request in reversed(running):
        if request.num_computed_tokens < prefill_end(request):
            if behind:
                room[request.request_id] = behind
            continue
        behind += 1 + len(request.spec_token_ids)
    return room


def paced_chunk(request: Request, start: int, num_new_tokens: int, page: int) -> int:
    """The chunk a paced step allows, ended on a multiple of ``page`` unless
    it finishes the prompt (as upstream's split on its block); 0: none fits."""
    end = start + num_new_tokens
    if end >= prefill_end(request):
        return num_new_tokens
    return max(end // page * page - start, 0)


def budget_chunk(
    request: Request, start: int, num_new_tokens: int, room: int, page: int | None
) -> int | None:
    """The chunk for upstream's align split: less the decodes' ``room`` when
    the budget cut it, ended on a ``page`` multiple in a paced step (None:
    not paced); None when nothing is left to compute this step."""
    if room and start + num_new_tokens < prefill_end(request):
        num_new_tokens = max(num_new_tokens - room, 0)
        if num_new_tokens == 0:
            return None
    if page is not None:
        num_new_tokens = paced_chunk(request, start, num_new_tokens, page)
        if num_new_tokens == 0:
            return None
    return num_new_tokens


def deep_chunk_start(page: int | None, budget: int) -> int:
    """Prompt position from which unfinished chunks end on the next page; 0:
    never. Only in plans whose steps are never paced but whose token
    ``budget`` holds a page, and there only while the queue is long
    (:func:`cuts_deep_chunks`)."""
    if not page:
        return 0
    unpaced = paced_step_budget(budget, page) is None
    return DEEP_CHUNK_TOKENS if unpaced and page <= budget else 0


def cuts_deep_chunks(num_waiting: int) -> bool:
    """Whether a step of a plan with a deep-chunk start cuts deep chunks:
    while more than :data:`PACING_MAX_WAITING` requests wait (with fewer the
    queue is short and the first tokens' wait is the chunks themselves)."""
    return num_waiting > PACING_MAX_WAITING


def deep_chunk(
    request: Request, start: int, num_new_tokens: int, page: int, deep: int
) -> int:
    """The chunk ended on the next multiple of ``page`` when it starts at or
    past position ``deep`` (> 0) and does not finish the prefill; else
    unchanged."""
    end = start + num_new_tokens
    if not deep or start < deep or end >= prefill_end(request):
        return num_new_tokens
    return min(num_new_tokens, (start // page + 1) * page - start)


def admits_after_deep_cut(
    request: Request, start: int, num_new_tokens: int, page: int, budget: int
) -> bool:
    """Whether a step that cut a deep chunk admits a waiting request's chunk:
    when it finishes the prefill, or when the page is longer than the token
    budget (upstream's split then starts a prompt short of its block)."""
    return page > budget or start + num_new_tokens >= prefill_end(request)


def checkpoint_chunk(
    request: Request,
    start: int,
    num_new_tokens: int,
    interval: int,
    block: int,
    paced_on_checkpoints: bool,
) -> int:
    """The aligned chunk, ended where a prefill checkpoint needs its state.

    Normally at the next checkpoint it would run past. A paced step whose
    page multiples carry the checkpoints keeps those its chunk ends on; only
    a chunk reaching the prompt's own checkpoint stops at the last prefill
    checkpoint before it, as upstream's split stops at its last block edge,
    so that a first reuse of the prefix finds it.
    """
    prompt = request.num_prompt_tokens
    if paced_on_checkpoints:
        end = start + num_new_tokens
        if end < prompt_checkpoint(prompt, block):
            return num_new_tokens
        stop = last_prefill_checkpoint(start, end, prompt, interval, block)
        return num_new_tokens if stop is None else stop - start
    stop = next_prefill_checkpoint(start, prompt, interval, block)
    if stop is not None and stop < start + num_new_tokens:
        return stop - start
    return num_new_tokens


# -- admission's growth reserve ---------------------------------------------------


def growth_reserve_geometry(
    kv_cache_config: KVCacheConfig,
) -> tuple[int, int, int] | None:
    """(horizon in tokens, token block, token groups) of admission's growth
    reserve for a pooled plan with a state pool; None otherwise or when
    :data:`ADMISSION_GROWTH_STATE_PAGES` is 0."""
    if not isinstance(kv_cache_config, PooledKVCacheConfig):
        return None
    pages = ADMISSION_GROWTH_STATE_PAGES
    if pages <= 0 or not any(p.kind is PoolKind.STATE for p in kv_cache_config.pools):
        return None
    token = kv_cache_config.pool_by_kind(PoolKind.TOKEN)
    block = kv_cache_config.kv_cache_groups[token.group_ids[0]].kv_cache_spec
    horizon = int(pages * state_page_tokens(kv_cache_config))
    return horizon, block.block_size, len(token.group_ids)


def growth_blocks(
    request: Request, num_tokens: int, geometry: tuple[int, int, int]
) -> int:
    """Token-pool blocks a request holding ``num_tokens`` tokens' blocks
    still grows into: its next ``horizon`` tokens, or what its token budget
    (prompt and ``max_tokens``) has left if less, counted as the blocks that
    growth adds to those it holds (``geometry``: see
    :func:`growth_reserve_geometry`)."""
    horizon, block, groups = geometry
    end = request.num_prompt_tokens + request.max_tokens - 1
    grow = min(end - num_tokens, horizon)
    if grow <= 0:
        return 0
    return (cdiv(num_tokens + grow, block) - cdiv(num_tokens, block)) * groups


def growth_reserve_blocks(
    running: list[Request], geometry: tuple[int, int, int]
) -> int:
    """Token-pool blocks the ``running`` requests may grow into before a
    waiting request is admitted (:func:`growth_blocks` of each)."""
    return sum(
        growth_blocks(request, request.num_computed_tokens, geometry)
        for request in running
    )
