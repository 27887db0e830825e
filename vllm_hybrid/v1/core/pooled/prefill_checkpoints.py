"""Prefill checkpoints: states kept at a sparse interval during long prefills.

In align mode a state is written to its block only where a prefill chunk
ends, and vLLM keeps it only at "semantic" positions: the prompt's replay
boundary and shared-prefix junctions. A prefix that a later request shares (a
system prompt, a document, a tool description) is then found only from its
second reuse on: the first reuse computes it again and caches the junction.
Upstream's single pool hits some of it on the first reuse by accident: its
block is inflated until one attention page covers a state page, and a chunk
ends (and a state is kept) at the prompt's last edge of that large block.

Pooled mode keeps a state every ``interval`` tokens of a prefill instead: the
scheduler ends a chunk there (:class:`~vllm_hybrid.v1.core.sched.scheduler.
PooledSchedulerMixin`) and retention caches it
(:class:`~vllm_hybrid.v1.core.retention.TurnEndRetentionMixin`). Each costs a
state block while it stays cached (an ordinary LRU entry), one state copy and,
where the chunk would not have ended there anyway, one more prefill step.

The interval (:func:`prefill_checkpoint_interval`) is the larger of

* the *state page in tokens*: state bytes of one layer over the attention
  bytes one token takes in one layer, i.e. the block upstream's single pool
  inflates attention to. Checkpoints there are never sparser than upstream's
  accidental ones, so a first reuse never hits less than upstream;
* the *budget term*: ``4 * max_model_len * state block / arena``, so the
  checkpoints of one ``max_model_len`` prompt hold at most a quarter of the
  arena;

rounded up to the state block (checkpoint positions are state block edges).

Anchors (:func:`prefill_checkpoint_anchor`). A freed prefill checkpoint is
speculative and goes to the head of its pool's eviction order, so it only
uses memory no other entry wants. Every few of them, at multiples of the
*anchor step*, is kept as an ordinary LRU entry instead. The step is the
prefix whose attention KV (all attention layers) weighs one state block,
rounded to a whole number of intervals: the density at which a cached
prefix's checkpoints take as many bytes in the state pool as the prefix
itself in the token pool. Qwen3.6-35B-A3B has 30 GDN and 10 attention
layers, so that is every third checkpoint; under two intervals there are
no anchors. When states are the scarce side (a
large budget and cheap attention, as turboquant_k8v4 at 141 GB) the anchors
survive where the checkpoints between them are evicted. Checkpoints every
state page stay where there is room. The positions and the first-reuse
guarantee above do not change.
"""

from __future__ import annotations

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

#: Share of the arena one ``max_model_len`` prompt's prefill checkpoints may
#: hold at most, as its inverse.
ARENA_SHARE_INVERSE = 4


def token_pool_bytes_per_token(config: PooledKVCacheConfig) -> float:
    """Bytes one token takes in the token pool: every attention layer's KV."""
    token = config.pool_by_kind(PoolKind.TOKEN)
    token_spec = config.kv_cache_groups[token.group_ids[0]].kv_cache_spec
    return token.block_bytes / token_spec.block_size


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


#: Fewest intervals between anchors. At one, every prefill checkpoint would
#: be an ordinary entry: a long prompt's checkpoints then pushed a repeated
#: prompt's own checkpoints out (see :data:`~.eviction.PLACES`).
MIN_ANCHOR_INTERVALS = 2


def prefill_checkpoint_anchor(config: PooledKVCacheConfig, interval: int) -> int:
    """Tokens between the prefill checkpoints kept in plain LRU order (a
    multiple of ``interval``); 0 for none: no prefill checkpoints, or a
    balanced density under :data:`MIN_ANCHOR_INTERVALS` intervals."""
    if interval <= 0:
        return 0
    per_token = token_pool_bytes_per_token(config)
    balanced = config.layout.state_block_bytes / max(per_token, 1.0)
    intervals = round(balanced / interval)
    return intervals * interval if intervals >= MIN_ANCHOR_INTERVALS else 0


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
