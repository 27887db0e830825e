"""Align mode's block-edge state copies on pooled state views (see
align_copy_ops and state_check), on a Mamba2 arena (the kernels copy bytes;
small pages keep the interpreter quick): both copy paths, in three boundary
cases each, including a copy onto the same block (pooled mode lends a
request its own block when the arena is short)."""

from __future__ import annotations

import pytest
import torch
from align_copy_ops import Crossing, batch_memcpy_copy, fused_precopy
from arena_views import MiB, mamba2_spec
from state_check import Case, case_arena, check_state_op, page_states, pick_ids

CASES = {
    batch_memcpy_copy: [
        Case(True, "min", odd_budget=True),
        Case(False, "initial"),
        Case(True, "max"),
    ],
    fused_precopy: [
        Case(False, "min"),
        Case(True, "initial", odd_budget=True),
        Case(False, "max"),
    ],
}
PARAMS = [(path, case) for path, cases in CASES.items() for case in cases]


def crossings(ids: list[int], with_bias: bool) -> list[Crossing]:
    """Two requests moving to a fresh block (one with an accepted-token
    bias where the path takes one) and one keeping its block; where the
    state pool owns one block, the last alone."""
    if len(ids) == 1:
        return [Crossing((ids[0], ids[0]), 0, 1)]
    a, b, c, x, d, e = ids
    second = Crossing((c, x, d), 0, 2, bias=1) if with_bias else Crossing((c, d), 0, 1)
    return [Crossing((a, b), 0, 1), second, Crossing((e, e), 0, 1)]


@pytest.mark.parametrize(
    "path, case", PARAMS, ids=[f"{p.__name__}-{c}" for p, c in PARAMS]
)
def test_align_copy(path, case):
    arena = case_arena(case, mamba2_spec(16), arena_bytes=8 * MiB, num_state_layers=2)
    ids = pick_ids(arena, 6)
    moves = crossings(ids, with_bias=path is fused_precopy)
    expected = {}

    def op(states, _ids):
        if not expected:  # the pooled run comes first, on the seeded pages
            expected.update(_expected_pages(arena, moves))
        return path(arena, states, moves)

    result = check_state_op(arena, op, ids)
    assert result.ok, result
    for (layer, dst), pages in expected.items():
        got = page_states(arena, layer, dst)
        equal = [torch.equal(g, p) for g, p in zip(got, pages, strict=True)]
        assert all(equal), (layer, dst, equal)


def _expected_pages(arena, moves: list[Crossing]) -> dict:
    """Destination pages after the copies: the source's states, the conv
    window shifted by the bias and the SSM state of the accepted column."""
    expected = {}
    for layer in arena.state_layers:
        for m in moves:
            conv, ssm = (s.clone() for s in page_states(arena, layer, m.row[m.src_col]))
            dst_conv, _ = (
                s.clone() for s in page_states(arena, layer, m.row[m.dst_col])
            )
            width = conv.shape[0]
            dst_conv[: width - m.bias] = conv[m.bias :]
            accepted = page_states(arena, layer, m.row[m.src_col + m.bias])[1].clone()
            expected[(layer, m.row[m.dst_col])] = [
                dst_conv,
                accepted if m.bias else ssm,
            ]
    return expected
