"""Pure planning of pooled mode: a worker's layer specs at natural page
sizes and a byte budget become a :class:`PooledKVCacheConfig` (one token
group, one state group, both pools viewing one allocation). No engine
needed; docs/pooled-mode.md ("Layout") describes the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheTensor, MambaSpec

from vllm_hybrid.v1.core.pooled.boundary import (
    initial_state_blocks,
    plan_arena_layout,
)
from vllm_hybrid.v1.core.pooled.capacity import (
    max_model_len_that_fits,
    max_state_blocks_per_request,
    min_state_blocks_per_request,
    request_bytes,
    token_capacity,
)
from vllm_hybrid.v1.core.pooled.layers import PoolLayers, PoolSplit, page_alignment
from vllm_hybrid.v1.core.pooled.spec import (
    VIEW_ALIGNMENT_BYTES,
    KVPoolSpec,
    PooledKVCacheConfig,
    PoolKind,
    align_down,
    null_region_bytes,
)

#: The engine options that set the KV budget, as its messages name them.
ENGINE_BUDGET_OPTIONS = "--kv-cache-memory-bytes or --gpu-memory-utilization"


@dataclass(frozen=True)
class BudgetShortfall:
    """What one request needs that the budget lacks, carried with the error
    so that each front end names its own options around one message."""

    arena_bytes: int
    max_model_len: int
    attention_bytes: int
    state_bytes: int
    null_bytes: int
    #: Longest max_model_len one request can use here; 0 if none fits.
    fitting_max_model_len: int

    @property
    def needed_bytes(self) -> int:
        return self.attention_bytes + self.state_bytes + self.null_bytes

    def message(self, budget_options: str = ENGINE_BUDGET_OPTIONS) -> str:
        """The message, advising to raise ``budget_options``."""
        lower = (
            f"or lower --max-model-len to {self.fitting_max_model_len}"
            if self.fitting_max_model_len > 0
            else "(no --max-model-len fits: one request's state and one attention "
            "block do not fit)"
        )
        mib = 2**20
        return (
            f"The KV cache budget of {self.arena_bytes / mib:.2f} MiB cannot hold "
            f"one request of max_model_len={self.max_model_len} tokens in pooled "
            f"mode ({self.needed_bytes / mib:.2f} MiB needed: attention "
            f"{self.attention_bytes / mib:.2f} MiB, state "
            f"{self.state_bytes / mib:.2f} MiB, null blocks "
            f"{self.null_bytes / mib:.2f} MiB). Raise {budget_options}, {lower}."
        )


class PooledPlanError(ValueError):
    """The budget cannot hold what one request needs; names the fix."""

    def __init__(self, message: str, shortfall: BudgetShortfall | None = None):
        super().__init__(message)
        self.shortfall = shortfall


@dataclass(frozen=True)
class PooledBudget:
    """Inputs of the arena plan that are not layer specs."""

    arena_bytes: int
    max_model_len: int
    max_num_seqs: int
    #: Null blocks may overlap owned blocks (see ``ArenaLayout``).
    null_blocks_overlap: bool = False

    @property
    def aligned_arena_bytes(self) -> int:
        """The budget rounded down to ``VIEW_ALIGNMENT_BYTES``, so the state
        pool starts aligned whatever budget a user passes."""
        return align_down(self.arena_bytes)


def plan_pooled_kv_cache(split: PoolSplit, budget: PooledBudget) -> PooledKVCacheConfig:
    """Lay out the arena for ``split`` in ``budget.arena_bytes`` bytes."""
    assert split.token is not None and split.state is not None
    token, state = split.token, split.state
    tb, sb = token.block_bytes, state.block_bytes
    block_size = token.spec.block_size
    assert isinstance(state.spec, MambaSpec)
    per_req = max_state_blocks_per_request(state.spec)
    lone = min_state_blocks_per_request(state.spec)
    arena = budget.aligned_arena_bytes
    # The boundary's start and floors; it moves at run time from there.
    start = initial_state_blocks(arena, sb, per_req, budget.max_num_seqs)
    layout = plan_arena_layout(arena, tb, sb, lone, budget.null_blocks_overlap, start)
    if layout is None or token_capacity(layout, block_size) < budget.max_model_len:
        shortfall = _shortfall(tb, sb, block_size, lone, budget)
        raise PooledPlanError(shortfall.message(), shortfall)
    state_offset = layout.state_offset
    groups = [
        KVCacheGroupSpec(list(token.layer_names), token.spec),
        KVCacheGroupSpec(list(state.layer_names), state.spec),
    ]
    tensors = [
        KVCacheTensor(
            size=arena,
            layers=list(run.layer_names),
            layer_stride=run.layer_stride,
            block_stride=layers.block_bytes,
            offset=base + run.offset,
        )
        for layers, base in ((token, 0), (state, state_offset))
        for run in layers.runs
    ]
    _check_alignment(tensors)
    return PooledKVCacheConfig(
        num_blocks=layout.num_token_ids,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        pools=[
            KVPoolSpec(PoolKind.TOKEN, (0,), tb, layout.num_token_ids),
            KVPoolSpec(PoolKind.STATE, (1,), sb, layout.num_state_ids),
        ],
        arena=layout,
        max_state_blocks_per_request=per_req,
    )


def _check_alignment(tensors: list[KVCacheTensor]) -> None:
    """Pool bases and strides are aligned as :func:`page_alignment` and
    ``VIEW_ALIGNMENT_BYTES`` require."""
    for tensor in tensors:
        page = page_alignment(tensor.layer_stride)
        for name, alignment in (
            ("offset", page),
            ("layer_stride", page),
            ("block_stride", VIEW_ALIGNMENT_BYTES),
        ):
            value = getattr(tensor, name)
            if value % alignment:
                raise AssertionError(
                    f"pooled KV tensor of {tensor.layers[0]}: {name} {value} B "
                    f"is not a multiple of {alignment} B"
                )


def auto_fit_max_model_len(split: PoolSplit, budget: PooledBudget) -> int:
    """Longest ``max_model_len`` one request can use in this budget (for
    ``--max-model-len -1``), capped at ``budget.max_model_len``."""
    assert split.token is not None and split.state is not None
    tb, sb = split.token.block_bytes, split.state.block_bytes
    assert isinstance(split.state.spec, MambaSpec)
    fits = max_model_len_that_fits(
        budget.aligned_arena_bytes,
        budget.null_blocks_overlap,
        tb,
        sb,
        split.token.spec.block_size,
        min_state_blocks_per_request(split.state.spec),
    )
    return min(fits, budget.max_model_len)


def _shortfall(
    tb: int, sb: int, block_size: int, per_req: int, budget: PooledBudget
) -> BudgetShortfall:
    arena, overlap = budget.aligned_arena_bytes, budget.null_blocks_overlap
    needed = request_bytes(budget.max_model_len, block_size, tb, sb, per_req)
    return BudgetShortfall(
        arena_bytes=arena,
        max_model_len=budget.max_model_len,
        attention_bytes=needed.attention_bytes,
        state_bytes=needed.state_bytes,
        null_bytes=null_region_bytes(tb, sb, overlap),
        fitting_max_model_len=max_model_len_that_fits(
            arena, overlap, tb, sb, block_size, per_req
        ),
    )


def describe_plan(config: PooledKVCacheConfig) -> str:
    """One log line: pools, page sizes, block counts, boundary."""
    token = config.pool_by_kind(PoolKind.TOKEN)
    state = config.pool_by_kind(PoolKind.STATE)
    tok_group = config.kv_cache_groups[token.group_ids[0]]
    st_group = config.kv_cache_groups[state.group_ids[0]]
    gcd = math.gcd(token.block_bytes, state.block_bytes)
    state_page = st_group.kv_cache_spec.page_size_bytes
    padding = state.block_bytes - len(st_group.layer_names) * state_page
    return (
        f"KV cache plan (pooled): arena {config.arena_bytes / 2**20:.2f} MiB; "
        f"token pool: {len(tok_group.layer_names)} attention layers, block "
        f"{tok_group.kv_cache_spec.block_size} tokens, "
        f"{_describe_pages(tok_group)}, block {token.block_bytes} B, "
        f"{token.num_blocks} ids; state pool: {len(st_group.layer_names)} state "
        f"layers, page {state_page} B ({padding} B padding), "
        f"block {state.block_bytes} B, {state.num_blocks} ids, "
        f"{config.max_state_blocks_per_request} per request; boundary at "
        f"{config.initial_boundary / 2**20:.2f} MiB (moves at run time, "
        f"granularity gcd {gcd} B)"
    )


def _describe_pages(group: KVCacheGroupSpec) -> str:
    """``page N B``, or ``pages N B x k + M B x j``."""
    runs = PoolLayers(group.kv_cache_spec, tuple(group.layer_names)).runs
    if len(runs) == 1:
        return f"page {runs[0].page_bytes} B"
    return "pages " + " + ".join(
        f"{run.page_bytes} B x {len(run.layer_names)}" for run in runs
    )
