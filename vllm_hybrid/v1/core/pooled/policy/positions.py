"""Where states are kept: prefill checkpoints, the prompt's own checkpoint,
turn ends, and how each kept one is filed once freed.

In align mode a state reaches a block only where a chunk ends or a decode
crosses a state block edge, and is cached only where a position is kept.
Positions (:class:`CheckpointPolicy`): the prompt's own checkpoint (its
replay boundary) and shared-prefix junctions, as upstream; every multiple of
``--prefix-cache-retention-interval``; prefill checkpoints every
``interval`` tokens of a long prompt, so a shared prefix hits on its first
reuse; the turn end a follow-up resumes from (:class:`DecodeEdges`).

The interval is the larger of the *state page in tokens* (upstream's block,
so a first reuse never hits less than upstream) and the *budget term*
``4 * max_model_len * state block / arena`` (one prompt's checkpoints hold at
most a quarter of the arena), in whole state blocks.

Kinds: freed turn ends and prefill checkpoints are speculative, filed first
to go (:data:`~.eviction.PLACES`), except an *anchor* every few prefill
checkpoints (:func:`prefill_checkpoint_anchor`), kept in LRU order: the step
is the prefix whose attention KV weighs one state block, in whole intervals
(every third for Qwen3.6-35B-A3B; none under two).
A prompt's own checkpoint and its last prefill checkpoint compete for the
LRU order by the hits each kind served (:data:`~.eviction.RIVALS`).
What a kept checkpoint saves (:func:`saved_tokens`) weighs it against
attention KV (:func:`state_block_attention_tokens`, the break-even).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybrid.v1.core.pooled.policy.eviction import Entry
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: Inverse share of the arena one long prompt's prefill checkpoints may hold.
ARENA_SHARE_INVERSE = 4


def token_pool_bytes_per_token(config: PooledKVCacheConfig) -> float:
    """Bytes one token takes in the token pool: every attention layer's KV."""
    token = config.pool_by_kind(PoolKind.TOKEN)
    token_spec = config.kv_cache_groups[token.group_ids[0]].kv_cache_spec
    return token.block_bytes / token_spec.block_size


def state_block_attention_tokens(config: PooledKVCacheConfig) -> float:
    """Tokens of attention KV (every attention layer) one state block's
    bytes hold: where a state entry saves as much per byte as attention."""
    per_token = max(token_pool_bytes_per_token(config), 1.0)
    return config.layout.state_block_bytes / per_token


def state_page_tokens(config: PooledKVCacheConfig) -> int:
    """Tokens of attention KV, per attention layer, that one state layer's
    page weighs: the block upstream's single pool inflates attention to."""
    token = config.pool_by_kind(PoolKind.TOKEN)
    state = config.pool_by_kind(PoolKind.STATE)
    token_layers = len(config.kv_cache_groups[token.group_ids[0]].layer_names)
    state_group = config.kv_cache_groups[state.group_ids[0]]
    per_token_layer = token_pool_bytes_per_token(config) / token_layers
    per_state_layer = state.block_bytes / len(state_group.layer_names)
    return cdiv(int(per_state_layer), max(1, int(per_token_layer)))


# -- prefill checkpoint positions ----------------------------------------------


def prefill_checkpoint_interval(
    config: PooledKVCacheConfig, max_model_len: int, requested: int | None
) -> int:
    """Tokens between prefill checkpoints; 0 when there are none.

    ``requested`` is ``hybrid_kv.prefill_checkpoint_interval``: None picks the
    rule of the module docstring, 0 turns them off, a positive value is
    rounded up to the state block.
    """
    state_spec = config.kv_cache_groups[
        config.pool_by_kind(PoolKind.STATE).group_ids[0]
    ].kv_cache_spec
    if not isinstance(state_spec, MambaSpec) or state_spec.mamba_cache_mode != "align":
        return 0
    block = state_spec.block_size
    if requested is None:
        layout = config.layout
        budget = cdiv(
            ARENA_SHARE_INVERSE * max_model_len * layout.state_block_bytes,
            layout.arena_bytes,
        )
        requested = max(state_page_tokens(config), budget)
    interval = cdiv(requested, block) * block
    return interval if 0 < interval < max_model_len else 0


#: Fewest intervals between anchors (see :data:`~.eviction.PLACES`).
MIN_ANCHOR_INTERVALS = 2


def prefill_checkpoint_anchor(config: PooledKVCacheConfig, interval: int) -> int:
    """Tokens between the prefill checkpoints kept in plain LRU order (a
    multiple of ``interval``); 0 for none: no prefill checkpoints, or a
    balanced density under :data:`MIN_ANCHOR_INTERVALS` intervals."""
    if interval <= 0:
        return 0
    intervals = round(state_block_attention_tokens(config) / interval)
    return intervals * interval if intervals >= MIN_ANCHOR_INTERVALS else 0


def plan_prefill_checkpoints(
    config: PooledKVCacheConfig, max_model_len: int, requested: int | None
) -> tuple[int, int]:
    """(interval, anchor step) of a plan's prefill checkpoints, what the
    engine glue records on the config for the coordinator and scheduler."""
    interval = prefill_checkpoint_interval(config, max_model_len, requested)
    return interval, prefill_checkpoint_anchor(config, interval)


def is_prefill_anchor(num_tokens: int, anchor: int) -> bool:
    """Whether the prefill checkpoint at ``num_tokens`` is an anchor."""
    return anchor > 0 and num_tokens % anchor == 0


def prompt_checkpoint(num_prompt_tokens: int, block: int) -> int:
    """The prompt's own checkpoint (its replay boundary), kept anyway."""
    return max(num_prompt_tokens - 1, 0) // block * block


def prefill_checkpoints(num_prompt_tokens: int, interval: int, block: int) -> range:
    """Positions of a prompt's prefill checkpoints: multiples of
    ``interval`` below its own checkpoint."""
    if interval <= 0:
        return range(0)
    return range(interval, prompt_checkpoint(num_prompt_tokens, block), interval)


def next_prefill_checkpoint(
    start: int, num_prompt_tokens: int, interval: int, block: int
) -> int | None:
    """The first prefill checkpoint after ``start`` tokens, if any."""
    if interval <= 0:
        return None
    position = (start // interval + 1) * interval
    if position < prompt_checkpoint(num_prompt_tokens, block):
        return position
    return None


def last_prefill_checkpoint(
    start: int, end: int, num_prompt_tokens: int, interval: int, block: int
) -> int | None:
    """The last prefill checkpoint strictly between ``start`` and ``end``, if
    any: where a chunk that reaches the prompt's own checkpoint stops, as
    upstream's align split stops at the last block edge before it."""
    if interval <= 0:
        return None
    limit = min(end, prompt_checkpoint(num_prompt_tokens, block))
    position = (limit - 1) // interval * interval
    return position if start < position and position > 0 else None


# -- turn ends and the positions one request keeps -----------------------------


class DecodeEdges(Enum):
    """Which state block edges a decoding request keeps a state at.

    Align mode keeps a state at an edge by copying the running state into a
    fresh block when the request crosses it (the block it leaves holds the
    state at the edge). A crossing nobody keeps is advanced in place instead:
    the request's running block moves on to the next column, no copy, no new
    block. In the prompt the edges caching keeps (its replay boundary,
    prefill checkpoints, shared-prefix junctions) are kept whatever this
    says; a prefill chunk that ends on another edge is crossed in place
    unless this is ``EVERY``.
    """

    #: Every edge, the prompt's included (vLLM's align mode): one copy of the
    #: whole state per state block of output, each superseded by the next.
    EVERY = "every"
    #: Only the last edge the request's token budget (``max_tokens``) lets it
    #: reach: one copy per request, the turn end a follow-up resumes from
    #: when the reply ran to its budget. A reply that stops earlier (end of
    #: sequence, a stop string) keeps no turn end; a follow-up then resumes
    #: from the prompt's own checkpoint, as with upstream's defaults.
    BUDGET_END = "budget_end"
    #: None: decode never copies.
    NONE = "none"


#: Decode edges pooled mode keeps: the turn-end hits of replies that run to
#: their budget at one copy per request, where ``EVERY`` copies a state at
#: each edge, almost all superseded one block later
#: (benchmarks/results/sim-20261127-decode-copies.md).
DECODE_EDGES = DecodeEdges.BUDGET_END


def budget_end_edge(request: Request, block: int) -> int:
    """The last state block edge a request reaches before its token budget
    ends it: the last multiple of ``block`` up to the tokens it computes (all
    but its last sampled token). Crossed while decoding, it costs one copy;
    a reply that ends on it leaves the state in the running block, no copy.
    """
    return (request.num_prompt_tokens + request.max_tokens - 1) // block * block


def interval_keeps(retention_interval: int | None, num_tokens: int) -> bool:
    """Whether ``--prefix-cache-retention-interval`` keeps ``num_tokens``."""
    return bool(retention_interval) and num_tokens % retention_interval == 0


def replay_positions(
    request: Request, scheduler_block: int, use_eagle: bool
) -> tuple[int, ...]:
    """Upstream's semantic positions of a prompt (its replay boundaries)."""
    return tuple(
        replay_boundaries(request.num_prompt_tokens, scheduler_block, use_eagle)
    )


def decode_checkpoint_edge(num_tokens: int, block: int, prompt_len: int) -> int | None:
    """The decode checkpoint a group caching ``num_tokens`` holds: its last
    edge past the prompt. Up to it, the last block is the prompt's own
    checkpoint, which no decode edge may supersede (a resent prompt hits it)."""
    edge = num_tokens // block * block
    return edge if edge > prompt_len else None


class StatePositions(NamedTuple):
    """One caching call's positions in a state group: the boundaries for
    upstream's ``cache_blocks``, prefill checkpoints, a turn end or not."""

    boundaries: tuple[int, ...]
    prefill: range
    turn_end: bool


@dataclass(frozen=True)
class CheckpointPolicy:
    """One coordinator's positions and ranks (module docstring); upstream's
    coordinator holds the retention interval, given per call."""

    #: Whether turn ends are kept (``hybrid_kv.retain_turn_ends``).
    retain_turn_ends: bool = False
    #: Decode edges that keep a state; NONE when turn ends are not kept.
    decode_edges: DecodeEdges = DecodeEdges.NONE
    #: Tokens between prefill checkpoints, 0 for none (pooled mode only).
    prefill_interval: int = 0
    #: Tokens between the prefill checkpoints ranked as anchors (0: none).
    prefill_anchor: int = 0

    @classmethod
    def of(
        cls,
        retain: bool,
        prefill_interval: int = 0,
        prefill_anchor: int = 0,
        decode_edges: DecodeEdges = DecodeEdges.EVERY,
    ) -> CheckpointPolicy:
        """A coordinator's policy: decode edges count where turn ends do."""
        edges = decode_edges if retain else DecodeEdges.NONE
        return cls(retain, edges, prefill_interval, prefill_anchor)

    @property
    def adds_positions(self) -> bool:
        """Whether caching keeps any position beyond upstream's."""
        return self.retain_turn_ends or bool(self.prefill_interval)

    def prefill_positions(self, num_prompt_tokens: int, block: int) -> range:
        """Prefill checkpoints of a prompt in a state group of ``block``."""
        return prefill_checkpoints(num_prompt_tokens, self.prefill_interval, block)

    def keeps_turn_end(
        self,
        request: Request,
        num_tokens: int,
        block: int,
        retention_interval: int | None,
    ) -> bool:
        """Whether an align-mode state group caches ``num_tokens`` as a
        decode checkpoint (``block``: the group's state block)."""
        if (
            not self.retain_turn_ends
            or retention_interval is None
            or num_tokens <= request.num_prompt_tokens
        ):
            return False
        edges = self.decode_edges
        if edges is DecodeEdges.EVERY:
            return True
        if edges is DecodeEdges.NONE:
            return False
        return num_tokens // block * block == budget_end_edge(request, block)

    def state_positions(
        self,
        request: Request,
        num_tokens: int,
        block: int,
        retention_interval: int | None,
        replay: tuple[int, ...],
        align: bool,
    ) -> StatePositions:
        """What a group caching ``num_tokens`` of ``request`` keeps: the
        prompt's ``replay`` boundaries, and in an align-mode state group its
        prefill checkpoints and the turn end, if ``num_tokens`` is one."""
        turn_end = align and self.keeps_turn_end(
            request, num_tokens, block, retention_interval
        )
        prefill = (
            self.prefill_positions(request.num_prompt_tokens, block)
            if align
            else range(0)
        )
        boundaries = (*replay, *prefill, *((num_tokens,) if turn_end else ()))
        return StatePositions(boundaries, prefill, turn_end)

    def keeps_edge(
        self,
        request: Request,
        edge: int,
        block: int,
        retention_interval: int | None,
        scheduler_block: int,
        use_eagle: bool,
    ) -> bool:
        """Whether a request crossing the state block edge ``edge`` must keep
        the state there in a block of its own (else it may cross in place):
        every edge with ``EVERY`` (vLLM's align mode), under dense retention
        or on the retention interval; in the prompt its replay boundaries,
        a junction, the prefill checkpoints; past it the turn end."""
        if self.decode_edges is DecodeEdges.EVERY:
            return True
        if retention_interval is None or interval_keeps(retention_interval, edge):
            return True
        prompt = request.num_prompt_tokens
        if edge > prompt:
            return self.keeps_turn_end(request, edge + 1, block, retention_interval)
        replay = replay_positions(request, scheduler_block, use_eagle)
        boundaries = [*replay, request.shared_prefix_boundary or 0]
        if any(b // block * block == edge for b in boundaries if b):
            return True
        return edge in self.prefill_positions(prompt, block)

    def keeps_superseded(
        self, previous_tokens: int, held: bool, retention_interval: int | None
    ) -> bool:
        """Whether a decode checkpoint a later one replaced stays cached
        (held by another request, or on the retention interval); else it
        serves no hit and ranks :attr:`~.eviction.Entry.SUPERSEDED`."""
        return interval_keeps(retention_interval, previous_tokens) or held

    def prompt_entry(
        self, num_tokens: int, num_prompt_tokens: int, block: int, positions: range
    ) -> Entry | None:
        """How the state a prefill chunk ending at ``num_tokens`` leaves ranks
        once freed (``positions``: the prompt's prefill checkpoints); None: no
        checkpoint of this policy, upstream's order."""
        if num_tokens == prompt_checkpoint(num_prompt_tokens, block):
            return Entry.PROMPT
        if num_tokens not in positions:
            return None
        if is_prefill_anchor(num_tokens, self.prefill_anchor):
            return Entry.PREFILL_ANCHOR
        return Entry.PREFILL_LAST if num_tokens == positions[-1] else Entry.PREFILL


def saved_tokens(kept_at: int, position: int) -> int:
    """Prompt tokens a hit on a checkpoint at ``position`` saves: those past
    the previous state its request kept or started from (``kept_at``), which
    a hit there would have to recompute."""
    return max(0, position - kept_at)
