"""A Mamba2 mixer's state kernels on pooled state views (see state_check and
mamba2_ops): Nemotron-H-like head dimensions with four heads, two state
layers, bf16 conv state, float32 SSM state. The two tests split the six
boundary cases between them, so every kernel runs in both null-block modes
and the decode kernels at every boundary position; overlap cases use odd
budgets (state views 256-byte aligned only)."""

from __future__ import annotations

from functools import partial

import pytest
from arena_views import MiB, mamba2_spec
from mamba2_ops import Mamba2Batch, mamba2_step, mamba2_weights
from state_check import Case, case_arena, check_state_op, pick_ids

WEIGHTS = mamba2_weights()
ARENA_BYTES = 8 * MiB
STATE_LAYERS = 2

#: Two decodes, a prompt continuing from its state, a fresh prompt; where
#: the state pool owns one block, the continuing prompt alone.
MIXED = Mamba2Batch(lens=[1, 1, 16, 8], has_initial_state=[True, True, True, False])
CONTINUATION = Mamba2Batch(lens=[16], has_initial_state=[True], seed=MIXED.seed)


def arena_for(case: Case):
    return case_arena(
        case, mamba2_spec(16), arena_bytes=ARENA_BYTES, num_state_layers=STATE_LAYERS
    )


@pytest.mark.parametrize(
    "case",
    [Case(False, "min"), Case(True, "initial", odd_budget=True), Case(False, "max")],
    ids=str,
)
def test_mamba2_mixed_batch(case):
    """``causal_conv1d_fn`` + the SSD chunk scan for the prompts,
    ``causal_conv1d_update`` + ``selective_state_update`` for the decodes."""
    arena = arena_for(case)
    ids = pick_ids(arena, len(MIXED.lens))
    batch = MIXED if len(ids) == len(MIXED.lens) else CONTINUATION
    assert len(ids) == len(batch.lens)
    op = partial(mamba2_step, batch=batch, weights=WEIGHTS)
    result = check_state_op(arena, op, ids)
    assert result.ok, result


@pytest.mark.parametrize(
    "case",
    [Case(True, "min", odd_budget=True), Case(False, "initial"), Case(True, "max")],
    ids=str,
)
def test_mamba2_decode_with_cuda_graph_padding(case):
    """Decodes padded with state id 0 (the Mamba builder's CUDA-graph
    padding): the conv update skips the row and the state update masks its
    state load and store, so nothing is written through the null block."""
    arena = arena_for(case)
    ids = pick_ids(arena, 2)
    rows = [*ids, 0]
    batch = Mamba2Batch(lens=[1] * len(rows), has_initial_state=[True] * len(rows))
    op = partial(mamba2_step, batch=batch, weights=WEIGHTS)
    result = check_state_op(arena, op, rows)
    assert result.ok, result
