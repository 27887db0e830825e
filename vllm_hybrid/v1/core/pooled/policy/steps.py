"""What one scheduler step computes and admits: where prefill chunks end,
prefill pacing, room for the decodes behind a prompt, admission's growth
reserve. The scheduler holds the step's state and asks; docs/pooled-mode.md
("Prefill pacing", "Admission growth reserve") states the rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from vllm_hybrid.v1.core.pooled.policy.eviction import Entry
from vllm_hybrid.v1.core.pooled.policy.positions import (
    last_prefill_checkpoint,
    next_prefill_checkpoint,
    prompt_checkpoint,
    state_page_tokens,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.v1.request import Request


#: While at most this many requests wait, steps are paced (chunks end on state
#: pages) so that decodes wait less; with more, queueing dominates
#: (benchmarks/results/sim-20261128-prefill-pacing.md).
PACING_MAX_WAITING = 4

#: State pages a step's budget must hold to be paced: halving one-page steps,
#: bound by reading the weights, lengthened the decode tail
#: (benchmarks/results/sim-20261128-prefill-pacing.md).
PACING_MIN_PAGES = 2

#: Whether a chunk the budget cut leaves room for the decodes scheduled after
#: it, as upstream's block-sized cut does
#: (benchmarks/results/sim-20261128-admission.md).
DECODE_ROOM = True

#: Prompt position from which an unfinished chunk ends on the next state page:
#: a deep chunk's attention work makes every decode of its step wait
#: (benchmarks/results/sim-20261201-deep-chunks.md).
DEEP_CHUNK_TOKENS = 4096

#: Admission's growth reserve in state pages (0: off): room every running
#: request keeps to grow, as upstream's large block keeps it implicitly
#: (benchmarks/results/sim-20261127-decode-copies.md).
ADMISSION_GROWTH_STATE_PAGES = 1.0


def junction_stop(start: int, junction: int, block: int) -> int:
    """Where upstream's split stops a chunk from ``start`` for a shared-prefix
    junction: the junction floored to whole blocks from ``start``."""
    return start + (junction - start) // block * block


def junction_worth_a_step(start: int, junction: int, block: int) -> bool:
    """Whether a chunk from ``start`` ends at the shared-prefix junction: only
    when the stop lies more than one block past ``start`` (the state at
    ``start``, a hit or a chunk end, saves a sibling all but that block)."""
    return junction_stop(start, junction, block) - start > block


@dataclass
class StepPlan:
    """What one step's prefill chunks follow, decided at its start, and
    whether the step cut a deep chunk yet."""

    #: the step's token budget is paced (:func:`paces`)
    paced: bool = False
    #: the step cuts chunks deep in a prompt (:func:`cuts_deep_chunks`)
    deep: bool = False
    #: decode tokens of the running requests after each prefilling one
    #: (:func:`decode_room`; empty: no room kept)
    decode_room: Mapping[str, int] = field(default_factory=dict)
    #: a chunk of this step was cut deep in its prompt
    cut_deep: bool = False
    #: paced chunks reaching a prompt's own checkpoint also stop at the last
    #: prefill checkpoint (:func:`keeps_last_checkpoint`)
    keep_last: bool = True
    #: chunks finishing a prompt stop at its own checkpoint
    #: (:func:`keeps_prompt_checkpoint`)
    keep_prompt: bool = True


def state_checkpoint_block(
    kv_cache_config: KVCacheConfig, mamba_cache_mode: str
) -> int | None:
    """The state block prefill chunks must end on (align mode), where it is
    longer than the attention block."""
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
    """The state page in tokens, rounded up to the state block, that paced
    steps end chunks on; None outside align mode or without a state pool."""
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
    """The largest multiple of ``page`` within ``budget``; None when steps
    are never paced (no page, or under :data:`PACING_MIN_PAGES` pages)."""
    if page is None:
        return None
    pages = budget // page
    return pages * page if pages >= PACING_MIN_PAGES else None


def paces(num_waiting: int, paced_budget: int | None) -> bool:
    """Whether a step is paced: a paced budget, and at most
    :data:`PACING_MAX_WAITING` requests wait."""
    return paced_budget is not None and num_waiting <= PACING_MAX_WAITING


def checkpoints_on_pace(interval: int, page: int | None) -> bool:
    """Whether prefill checkpoints lie on page multiples."""
    return bool(page and interval % page == 0)


def prefill_end(request: Request) -> int:
    """Where a request's prefill ends (a resumed one replays its output)."""
    return max(request.num_prompt_tokens, request.num_tokens - 1)


def decode_room(running: list[Request]) -> dict[str, int]:
    """Per prefilling request, the decode tokens (drafts included) of the
    running requests after it."""
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
    """The chunk ended on a multiple of ``page`` unless it finishes the
    prefill; 0: none fits."""
    end = start + num_new_tokens
    if end >= prefill_end(request):
        return num_new_tokens
    return max(end // page * page - start, 0)


def budget_chunk(
    request: Request, start: int, num_new_tokens: int, room: int, page: int | None
) -> int | None:
    """The chunk less the decodes' ``room`` where the budget cut it, ended
    on a ``page`` multiple when paced; None when nothing is left this step."""
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
    """Prompt position from which unfinished chunks end on the next page
    (0: never): only where steps are never paced but ``budget`` holds a page."""
    if not page:
        return 0
    unpaced = paced_step_budget(budget, page) is None
    return DEEP_CHUNK_TOKENS if unpaced and page <= budget else 0


def cuts_deep_chunks(num_waiting: int) -> bool:
    """Whether a step cuts deep chunks: while more than
    :data:`PACING_MAX_WAITING` requests wait (a short queue waits on the
    chunks themselves)."""
    return num_waiting > PACING_MAX_WAITING


def deep_chunk(
    request: Request, start: int, num_new_tokens: int, page: int, deep: int
) -> int:
    """The chunk ended on the next ``page`` multiple when it starts at or
    past ``deep`` (> 0) and does not finish the prefill."""
    end = start + num_new_tokens
    if not deep or start < deep or end >= prefill_end(request):
        return num_new_tokens
    return min(num_new_tokens, (start // page + 1) * page - start)


def admits_after_deep_cut(
    request: Request, start: int, num_new_tokens: int, page: int, budget: int
) -> bool:
    """Whether a step that cut a deep chunk admits a waiting request's chunk:
    one that finishes its prefill, or any where the page exceeds the budget."""
    return page > budget or start + num_new_tokens >= prefill_end(request)


def keeps_last_checkpoint(rival_hits: Mapping[Entry, float]) -> bool:
    """Whether a paced chunk reaching the prompt's own checkpoint also stops
    at the last prefill checkpoint before it, one step more for the prompt:
    unless prompts' own checkpoints served more prefix hits lately
    (:data:`~.eviction.RIVALS`), so that a prefix's first reuse hits there."""
    return rival_hits.get(Entry.PREFILL_LAST, 0) >= rival_hits.get(Entry.PROMPT, 0)


def keeps_prompt_checkpoint(rival_hits: Mapping[Entry, float]) -> bool:
    """Whether a chunk finishing its prompt stops at the prompt's own
    checkpoint (a step for its last tokens): not while turn ends served more
    hits lately (follow-ups that repeat the reply resume at those)."""
    return rival_hits.get(Entry.TURN_END, 0) <= rival_hits.get(Entry.PROMPT, 0)


def checkpoint_chunk(
    request: Request,
    start: int,
    num_new_tokens: int,
    interval: int,
    block: int,
    paced_on_checkpoints: bool,
    keep_last: bool = True,
) -> int:
    """The chunk ended at the next prefill checkpoint it would run past; in
    a paced step whose pages carry the checkpoints, only a chunk reaching
    the prompt's own checkpoint stops, at the last prefill checkpoint, and
    only when ``keep_last`` (:func:`keeps_last_checkpoint`)."""
    prompt = request.num_prompt_tokens
    if paced_on_checkpoints:
        end = start + num_new_tokens
        if not keep_last or end < prompt_checkpoint(prompt, block):
            return num_new_tokens
        stop = last_prefill_checkpoint(start, end, prompt, interval, block)
        return num_new_tokens if stop is None else stop - start
    stop = next_prefill_checkpoint(start, prompt, interval, block)
    if stop is not None and stop < start + num_new_tokens:
        return stop - start
    return num_new_tokens


def growth_reserve_geometry(
    kv_cache_config: KVCacheConfig,
) -> tuple[int, int, int] | None:
    """(horizon in tokens, token block, token groups) of the growth reserve
    of a pooled plan with a state pool; None otherwise or when it is off."""
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
    """Token-pool blocks a request holding ``num_tokens`` tokens grows into
    over its next ``horizon`` tokens or what its token budget has left."""
    horizon, block, groups = geometry
    end = request.num_prompt_tokens + request.max_tokens - 1
    grow = min(end - num_tokens, horizon)
    if grow <= 0:
        return 0
    return (cdiv(num_tokens + grow, block) - cdiv(num_tokens, block)) * groups


def growth_reserve_blocks(
    running: list[Request], geometry: tuple[int, int, int]
) -> int:
    """Token-pool blocks the ``running`` requests may grow into."""
    return sum(
        growth_blocks(request, request.num_computed_tokens, geometry)
        for request in running
    )
