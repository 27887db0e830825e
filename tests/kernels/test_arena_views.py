"""The arena builder itself: views alias one allocation, pools never share
a byte, and the canary check sees a stray write."""

from __future__ import annotations

import pytest
import torch
from arena_views import MiB, attention_spec, build_arena, gdn_spec

from vllm_hybrid.v1.core.pooled.spec import PoolKind


@pytest.mark.parametrize("block_size", [16, 32])
def test_views_alias_one_allocation_and_pools_are_disjoint(block_size):
    arena = build_arena(
        attention_spec(block_size), gdn_spec(block_size), arena_bytes=48 * MiB + 3
    )
    base = arena.raw.data_ptr()
    for view in arena.views.values():
        assert base <= view.data_ptr() < base + arena.raw.numel()
    tokens = arena.page_ranges(PoolKind.TOKEN, list(arena.token_ids))
    states = arena.page_ranges(PoolKind.STATE, list(arena.state_ids))
    spans = sorted(tokens + states)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= arena.raw.numel()
    conv, ssm = arena.states[arena.state_layers[0]]
    assert conv.dtype == torch.bfloat16 and ssm.dtype == torch.float32
    assert ssm.shape[1:] == (32, 128, 128)


def test_canary_sees_a_write_outside_owned_pages():
    arena = build_arena(attention_spec(16), gdn_spec(16), arena_bytes=48 * MiB)
    arena.fill_canary()
    ids = arena.pick(PoolKind.STATE, 2)
    owned = arena.page_ranges(PoolKind.STATE, ids)
    for sid in ids:
        arena.states[arena.state_layers[1]][1][sid].fill_(1.0)
    assert arena.bytes_changed_outside(owned) == 0
    stray = next(i for i in arena.state_ids if i not in ids)
    arena.states[arena.state_layers[1]][1][stray, 0, 0, 0] = 1.0
    assert arena.bytes_changed_outside(owned) == 4
