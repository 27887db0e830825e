"""Model Runner V2's align pre-copy without the copies of a block onto itself.

:func:`~vllm_hybrid.v1.worker.mamba_copies.keep_in_place` decides, with torch
ops over request slots, which of a batch's copies move nothing (one block id
in both columns of every state group, no accepted-token bias) and hands the
kernel those slots' destination column as their source. These tests run it
on CPU tensors laid out as V2 keeps them (per-slot columns and block-table
rows, batch order through ``idx_mapping``); tests/kernels/test_state_precopy_v2.py
runs the kernel on the result.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.worker import mamba_copies
from vllm_hybrid.v1.worker.mamba_copies import keep_in_place


def _i32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


#: Six request slots, two state groups, three block columns. Slot 0 crosses
#: in place in both groups; slot 1 to fresh blocks; slot 2 in place in group
#: 0 only; slot 3 in place with an accepted draft; slot 4 is fresh (-1);
#: slot 5 stays in its column.
TABLES = (
    _i32([[7, 7, 0], [3, 4, 0], [5, 5, 0], [6, 6, 0], [8, 0, 0], [9, 9, 0]]),
    _i32([[17, 17, 0], [13, 14, 0], [15, 16, 0], [12, 12, 0], [18, 0, 0], [1, 1, 0]]),
)
SRC = _i32([0, 0, 0, 0, -1, 1])
DST = _i32([1, 1, 1, 1, 0, 1])
BIAS = _i32([0, 0, 0, 1, 0, 0])


def test_only_copies_onto_themselves_without_a_bias_are_dropped():
    slots = _i32([4, 2, 0, 5, 1, 3])  # batch order, as idx_mapping
    before = SRC.clone()
    out = keep_in_place(TABLES, slots, DST, SRC, BIAS)
    assert out.tolist() == [1, 0, 0, 0, -1, 1]
    assert torch.equal(SRC, before) and out is not SRC
    # one state group alone naming one block in both columns is not enough
    out = keep_in_place(TABLES[:1], slots, DST, SRC, BIAS)
    assert out.tolist() == [1, 0, 1, 0, -1, 1]


def test_slots_outside_the_batch_and_left_out_rows_keep_their_sources():
    # slot 0 is not in the batch; a -1 row (left out) must not reach it
    out = keep_in_place(TABLES, _i32([-1, 2, 3]), DST, SRC, BIAS)
    assert out.tolist() == [0, 0, 0, 0, -1, 1]
    # the same slot listed twice, and a destination past the table's end
    dst = _i32([1, 3, 1, 1, 0, 1])
    out = keep_in_place(TABLES, _i32([0, 0, 1]), dst, SRC, BIAS)
    assert out.tolist() == [1, 0, 0, 0, -1, 1]


def _context(tables=None) -> SimpleNamespace:
    ctx = SimpleNamespace()
    if tables is not None:
        ctx.pooled_state_tables = tables
    return ctx


def test_the_pre_copy_launch_gets_them_on_pooled_configs_only(monkeypatch):
    """A context with pooled tables and a batch mapping (V2) launches with
    the dropped copies; without tables (other configs) or without a mapping
    (V1's fused path) upstream gets V2's tensors themselves."""
    launched: list = []

    def upstream(ctx, num_reqs, state_idx, src_col, bias, idx_mapping):
        launched.append((num_reqs, src_col))

    monkeypatch.setattr(mamba_copies, "upstream_of", lambda *_: upstream)
    slots = _i32([0, 1, 2, 3, 4, 5, -1])  # one padded row past num_reqs
    mamba_copies.run_fused_precopy(_context(TABLES), 6, DST, SRC, BIAS, slots)
    (n, src), *_ = launched
    assert (n, src.tolist()) == (6, [1, 0, 0, 0, -1, 1])
    for ctx, mapping in ((_context(), slots), (_context(TABLES), None)):
        launched.clear()
        mamba_copies.run_fused_precopy(ctx, 6, DST, SRC, BIAS, mapping)
        assert launched == [(6, SRC)] and launched[0][1] is SRC


@pytest.mark.parametrize("pooled", [True, False])
def test_the_context_keeps_the_tables_of_a_pooled_config(monkeypatch, pooled):
    calls: list = []
    monkeypatch.setattr(
        mamba_copies, "upstream_of", lambda *_: lambda *args: calls.append(args)
    )
    config = (PooledKVCacheConfig if pooled else KVCacheConfig)(0, [], [])
    ctx = _context()
    tables = list(TABLES)
    mamba_copies.initialize_from_forward_context(ctx, config, {}, {}, tables)
    assert calls == [(ctx, config, {}, {}, tables, None)]
    assert getattr(ctx, "pooled_state_tables", None) == (TABLES if pooled else None)
    # a context already set up keeps what it has, as upstream's does
    ctx = _context()
    ctx.is_initialized = True
    mamba_copies.initialize_from_forward_context(ctx, config, {}, {}, tables)
    assert not hasattr(ctx, "pooled_state_tables") and len(calls) == 2


@pytest.mark.parametrize(
    "name", ["initialize_from_forward_context", "run_fused_precopy"]
)
def test_the_replacements_take_upstreams_parameters(name):
    ours = inspect.signature(getattr(mamba_copies, name)).parameters
    theirs = inspect.signature(getattr(MambaSpecDecodeGPUContext, name)).parameters
    assert list(ours) == list(theirs)
