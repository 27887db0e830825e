"""Where states are kept (the prompt's own checkpoint, prefill checkpoints
and their anchors, turn ends), how each kept one ranks once freed and what
it saves. docs/pooled-mode.md ("Prefill checkpoints", "Turn-end
checkpoints") states the rules.
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

#: Inverse share of the arena one prompt's prefill checkpoints may hold, so
#: that one prompt cannot fill the state pool
#: (benchmarks/results/sim-20261126-mooncake-80tq.md).
ARENA_SHARE_INVERSE = 4


def token_pool_bytes_per_token(config: PooledKVCacheConfig) -> float:
    """Bytes one token takes in the token pool: every attention layer's KV."""
    token = config.pool_by_kind(PoolKind.TOKEN)
    token_spec = config.kv_cache_groups[token.group_ids[0]].kv_cache_spec
    return token.block_bytes / token_spec.block_size


def state_block_attention_tokens(config: PooledKVCacheConfig) -> float:
    """Tokens of attention KV one state block's bytes hold: the break-even
    of a state entry against attention KV."""
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


def prefill_checkpoint_interval(
    config: PooledKVCacheConfig, max_model_len: int, requested: int | None
) -> int:
    """Tokens between prefill checkpoints (0: none), rounded up to the state
    block. ``requested`` (``hybrid_kv.prefill_checkpoint_interval``) None
    picks the larger of the state page and the arena share."""
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


#: Fewest intervals between anchors: all-anchor pushes prompts' own out
#: (benchmarks/results/sim-20261127-gpu-sizes.md).
MIN_ANCHOR_INTERVALS = 2


def prefill_checkpoint_anchor(config: PooledKVCacheConfig, interval: int) -> int:
    """Tokens between anchors: the prefix whose attention KV weighs one
    state block, in whole intervals; 0 under :data:`MIN_ANCHOR_INTERVALS`."""
    if interval <= 0:
        return 0
    intervals = round(state_block_attention_tokens(config) / interval)
    return intervals * interval if intervals >= MIN_ANCHOR_INTERVALS else 0


def plan_prefill_checkpoints(
    config: PooledKVCacheConfig, max_model_len: int, requested: int | None
) -> tuple[int, int]:
    """(interval, anchor step) of a plan's prefill checkpoints."""
    interval = prefill_checkpoint_interval(config, max_model_len, requested)
    return interval, prefill_checkpoint_anchor(config, interval)


def is_prefill_anchor(num_tokens: int, anchor: int) -> bool:
    """Whether the prefill checkpoint at ``num_tokens`` is an anchor."""
    return anchor > 0 and num_tokens % anchor == 0


def prompt_checkpoint(num_prompt_tokens: int, block: int) -> int:
    """The prompt's own checkpoint (its replay boundary), kept anyway."""
    return max(num_prompt_tokens - 1, 0) // block * block


def prefill_checkpoints(num_prompt_tokens: int, interval: int, block: int) -> range:
    """Multiples of ``interval`` below the prompt's own checkpoint."""
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
    """The last prefill checkpoint strictly between ``start`` and ``end``,
    where a chunk reaching the prompt's own checkpoint stops."""
    if interval <= 0:
        return None
    limit = min(end, prompt_checkpoint(num_prompt_tokens, block))
    position = (limit - 1) // interval * interval
    return position if start < position and position > 0 else None


class DecodeEdges(Enum):
    """Which state block edges a decoding request keeps a state at (a copy
    into a fresh block); the others are crossed in place, with no copy. The
    prompt's kept positions are kept whatever this says."""

    #: Every edge, the prompt's included (vLLM's align mode).
    EVERY = "every"
    #: Only the last edge the token budget (``max_tokens``) lets the request
    #: reach: one copy, the turn end of a reply that ran to its budget.
    BUDGET_END = "budget_end"
    #: None: decode never copies.
    NONE = "none"


#: Decode edges kept: one copy per request, where ``EVERY`` copies at each edge
#: (benchmarks/results/sim-20261127-decode-copies.md).
DECODE_EDGES = DecodeEdges.BUDGET_END


def budget_end_edge(request: Request, block: int) -> int:
    """The last state block edge a request reaches before its token budget
    ends it (it computes all but its last sampled token)."""
    return (request.num_prompt_tokens + request.max_tokens - 1) // block * block


def keeps_a_turn_end_past_prompt(request: Request, block: int) -> bool:
    """Whether decoding keeps a turn end past the prompt's end: only its token
    budget ends the reply, and it reaches a state block edge past the prompt."""
    params = request.sampling_params
    if params is None or not params.ignore_eos or params.stop or params.stop_token_ids:
        return False
    if params.repetition_detection is not None:
        return False
    return budget_end_edge(request, block) > request.num_prompt_tokens


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
    edge, if past the prompt (no decode edge may supersede the prompt's)."""
    edge = num_tokens // block * block
    return edge if edge > prompt_len else None


class StatePositions(NamedTuple):
    """One caching call's positions in a state group."""

    boundaries: tuple[int, ...]
    prefill: range
    turn_end: bool


@dataclass(frozen=True)
class CheckpointPolicy:
    """One coordinator's positions and ranks (the retention interval is
    upstream's coordinator's, given per call)."""

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
        decode checkpoint."""
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
        """What a group caching ``num_tokens`` keeps: the ``replay``
        boundaries and, in align mode, prefill checkpoints and a turn end."""
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
        """Whether a request crossing ``edge`` must keep the state there in a
        block of its own (else it may cross in place)."""
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
        """Whether a replaced decode checkpoint stays cached (held, or on the
        retention interval); else it ranks ``Entry.SUPERSEDED``."""
        return interval_keeps(retention_interval, previous_tokens) or held

    def prompt_entry(
        self, num_tokens: int, num_prompt_tokens: int, block: int, positions: range
    ) -> Entry | None:
        """How the state a prefill chunk ending at ``num_tokens`` ranks once
        freed; None: no checkpoint of this policy (upstream's order)."""
        if num_tokens == prompt_checkpoint(num_prompt_tokens, block):
            return Entry.PROMPT
        if num_tokens not in positions:
            return None
        if is_prefill_anchor(num_tokens, self.prefill_anchor):
            return Entry.PREFILL_ANCHOR
        return Entry.PREFILL_LAST if num_tokens == positions[-1] else Entry.PREFILL


def saved_tokens(kept_at: int, position: int) -> int:
    """Prompt tokens a hit at ``position`` saves: those past the state its
    request kept or started from (``kept_at``)."""
    return max(0, position - kept_at)
