"""The state checker catches what this tier exists for: pooled state tensors
that are a few bytes off, have a wrong block stride, are a dense copy of the
views (a ``.contiguous()`` wrapper), or are addressed with a wrong state id.

Each test hands the pooled run of a Mamba2 decode step (``causal_conv1d_update``
+ ``selective_state_update``, in place on the views of the last state layer)
broken tensors or ids and requires :func:`~state_check.check_state_op` to
report the mismatch; the twins are always upstream's correct views. Faults
move addresses down only, so no kernel touches memory outside the arena.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from arena_views import MiB, mamba2_spec
from mamba2_ops import Mamba2Batch, mamba2_step, mamba2_weights
from state_check import Case, case_arena, check_state_op, pick_ids, state_spec_of

SHIFT = 256  # bytes


def shifted(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t`` moved by ``nbytes`` in its storage (strides unchanged)."""
    return t.as_strided(
        t.shape, t.stride(), t.storage_offset() + nbytes // t.element_size()
    )


def restrided(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t`` with its block stride changed by ``nbytes``."""
    stride = (t.stride(0) + nbytes // t.element_size(), *t.stride()[1:])
    return t.as_strided(t.shape, stride, t.storage_offset())


def layer_page(arena) -> int:
    return state_spec_of(arena).page_size_bytes


FAULTS = {
    "conv-view-256B-low": lambda a, conv, ssm: (shifted(conv, -SHIFT), ssm),
    "ssm-view-256B-low": lambda a, conv, ssm: (conv, shifted(ssm, -SHIFT)),
    "block-stride-one-layer-page-short": lambda a, conv, ssm: (
        restrided(conv, -layer_page(a)),
        restrided(ssm, -layer_page(a)),
    ),
    "contiguous-copy": lambda a, conv, ssm: (conv.contiguous(), ssm.contiguous()),
}


#: Broken views make the kernels read canary bytes as numbers (overflows in
#: NumPy, which the interpreter computes with).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def setup():
    arena = case_arena(
        Case(True, "initial"), mamba2_spec(16), arena_bytes=8 * MiB, num_state_layers=2
    )
    ids = pick_ids(arena, 2)
    batch = Mamba2Batch(lens=[1, 1], has_initial_state=[True, True])
    return arena, ids, partial(mamba2_step, batch=batch, weights=mamba2_weights())


def check(arena, op, ids, **faults):
    return check_state_op(arena, op, ids, layers=arena.state_layers[-1:], **faults)


def test_correct_views_pass(setup):
    arena, ids, op = setup
    result = check(arena, op, ids)
    assert result.ok, result


@pytest.mark.parametrize("fault", FAULTS, ids=str)
def test_wrong_view_is_caught(setup, fault):
    arena, ids, op = setup
    broken = {
        name: FAULTS[fault](arena, *arena.states[name]) for name in arena.state_layers
    }
    result = check(arena, op, ids, pooled_states=broken)
    assert not result.ok
    assert result.page_mismatches, result
    if fault == "contiguous-copy":
        # every write went to the copy: owned pages keep their seeds
        assert result.bytes_outside == 0, result


def test_off_by_one_state_id_is_caught(setup):
    arena, ids, op = setup
    ids = [arena.state_floor, *[i for i in ids if i != arena.state_floor][:1]]
    result = check(arena, op, ids, pooled_ids=[i - 1 for i in ids])
    assert not result.ok
    assert result.page_mismatches, result
    # the boundary id minus one is a token block (or the null block): bytes
    # outside the state pages changed
    assert result.bytes_outside > 0, result
