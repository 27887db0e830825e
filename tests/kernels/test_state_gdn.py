"""Qwen3.6's gated-DeltaNet kernels on pooled state views.

Each test runs the layer's kernels (see gdn_ops) on the views a pooled worker
binds and on contiguous twins, and requires equal outputs, equal owned pages
and no changed byte outside them (see state_check). Real Qwen3.6 GDN shapes
(16 k / 32 v heads x 128, conv kernel 4, bf16 conv state, float32 SSM state)
make every call cost seconds in the interpreter, so each test runs on the
last state layer (its pages end at a block edge) in the cases listed, which
cover both null-block modes and every boundary position; the Mamba2 tests
run the conv kernels with small shapes in more cases.
"""

from __future__ import annotations

from functools import partial

import pytest
from arena_views import gdn_spec
from gdn_ops import GDNBatch, decode_batch, gdn_decode, gdn_step, gdn_weights
from state_check import Case, case_arena, check_state_op, pick_ids

WEIGHTS = gdn_weights()

#: A decode (one token, shorter than the conv state) and a prompt continuing
#: from its state (two conv blocks of 8 tokens). A fresh prompt would double
#: the FLA kernels' cost; the Mamba2 tests run the conv kernel's fresh path.
MIXED = GDNBatch(lens=[1, 16], has_initial_state=[True, True])


@pytest.mark.parametrize(
    "case", [Case(True, "min", odd_budget=True), Case(False, "initial")], ids=str
)
def test_gdn_mixed_batch(case):
    """``causal_conv1d_fn`` over the batch, the decode through
    ``fused_sigmoid_gating_delta_rule_update``, the prompt through the FLA
    chunked kernels on states gathered from the views (in one process the
    second case reuses the first one's FLA outputs: the gathered states are
    equal, see ``state_ops.same_inputs_same_outputs``)."""
    arena = case_arena(case, gdn_spec(16))
    ids = pick_ids(arena, len(MIXED.lens))
    op = partial(gdn_step, batch=MIXED, weights=WEIGHTS)
    result = check_state_op(arena, op, ids, layers=arena.state_layers[-1:])
    assert result.ok, result


@pytest.mark.parametrize(
    "case, requests", [(Case(False, "max"), 1), (Case(True, "initial"), 2)], ids=str
)
def test_gdn_decode_with_cuda_graph_padding(case, requests):
    """``causal_conv1d_update`` and the packed recurrent decode, with a
    padded row (state id 0, as the GDN builder pads CUDA-graph batches):
    both kernels skip it, so nothing is written through the null block."""
    arena = case_arena(case, gdn_spec(16))
    ids = pick_ids(arena, requests)
    assert len(ids) == requests
    rows = [*ids, 0]
    op = partial(gdn_decode, batch=decode_batch(len(rows)), weights=WEIGHTS)
    result = check_state_op(arena, op, rows, layers=arena.state_layers[-1:])
    assert result.ok, result
