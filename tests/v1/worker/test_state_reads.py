"""Which prefill rows read their state out of place, and the runner and the
metadata builder agreeing on them (:mod:`vllm_hybrid.v1.worker.state_reads`).

The copy the runner drops must be a copy the layer no longer needs: every
row whose pre-copy is dropped must be a row the builder hands a read block.
The kernel tier (tests/kernels/test_gdn_out_of_place.py) checks that the
layer then computes what upstream computes after the copy.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybrid.v1.attention.backends import gdn_reads
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.worker import mamba_copies, state_reads
from vllm_hybrid.v1.worker.mamba_copies import keep_in_place


def _i32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


#: Per batch row: tokens computed before the step and tokens scheduled, at
#: 16-token state blocks and a 3-token conv state. Row 0 decodes across an
#: edge; row 1 is a 2-token chunk across one; rows 2 and 3 are chunks of 5
#: and 40 tokens continuing from a checkpoint in the block before; row 4 is a
#: fresh prompt; row 5 a chunk inside its own block; row 6 a prefix hit of
#: 32 tokens continuing with 20.
COMPUTED = _i32([16, 31, 32, 48, 0, 20, 32])
SCHEDULED = _i32([1, 2, 5, 40, 30, 4, 20])
BLOCK, MIN_TOKENS = 16, 3


def test_read_columns():
    seq_lens = COMPUTED + SCHEDULED
    columns = state_reads.read_columns(seq_lens, SCHEDULED, BLOCK, MIN_TOKENS)
    # rows 0, 1 and 4 read where they write; 2, 3, 5, 6 the block of their
    # last computed token (row 5's is its own block)
    assert columns.tolist() == [1, 2, 1, 2, 1, 1, 1]
    write = ((seq_lens - 1) // BLOCK).tolist()
    assert write == [1, 2, 2, 5, 1, 1, 3]
    table = torch.arange(70, dtype=torch.int32).view(7, 10) + 100
    ids = state_reads.read_state_ids(table, columns)
    assert ids.tolist() == [101, 112, 121, 132, 141, 151, 161]


def test_min_chunk_tokens_follows_the_conv_state_layout():
    assert state_reads.min_chunk_tokens((8192, 3), dim_first=True) == 3
    assert state_reads.min_chunk_tokens((3, 8192), dim_first=False) == 3
    # a width-2 conv (one token of state) still leaves decode rows alone
    assert state_reads.min_chunk_tokens((1, 64), dim_first=False) == 2


def test_engines_off_cuda_read_in_place():
    config = SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode="align"),
        speculative_config=None,
    )
    assert state_reads.reads_out_of_place(config) is False


def _built(rows: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_prefills=4,
        num_decodes=1,
        spec_sequence_masks=None,
        non_spec_state_indices_tensor=torch.zeros(rows, dtype=torch.int32),
    )


def _common(table: torch.Tensor) -> SimpleNamespace:
    starts = torch.cat((torch.zeros(1, dtype=torch.int32), SCHEDULED.cumsum(0)))
    return SimpleNamespace(
        num_reqs=7,
        query_start_loc=starts.to(torch.int32),
        seq_lens=COMPUTED + SCHEDULED,
        block_table_tensor=table,
    )


def test_the_builder_names_the_read_blocks_for_every_group(monkeypatch):
    built = _built(7)
    monkeypatch.setattr(gdn_reads, "upstream_of", lambda *_: lambda *a, **k: built)
    builder = SimpleNamespace(
        read_min_tokens=MIN_TOKENS,
        kv_cache_spec=SimpleNamespace(block_size=BLOCK),
        non_spec_state_indices_tensor=torch.zeros(9, dtype=torch.int32),
    )
    table = torch.arange(70, dtype=torch.int32).view(7, 10)
    metadata = gdn_reads.build(builder, 0, _common(table))
    assert metadata.read_state_columns.tolist() == [1, 2, 1, 2, 1, 1, 1]
    assert metadata.read_state_indices.tolist() == [1, 12, 21, 32, 41, 51, 61]
    # another state group: the same columns in its own table
    regathered = SimpleNamespace(non_spec_state_indices_tensor=None)
    monkeypatch.setattr(gdn_reads, "upstream_of", lambda *_: lambda *a: regathered)
    other = gdn_reads.update_block_table(builder, metadata, table + 500, None)
    assert other.read_state_indices.tolist() == [501, 512, 521, 532, 541, 551, 561]
    # engines that read in place, and batches without rows, get none
    for builder_tokens, prefills in ((None, 4), (MIN_TOKENS, 0)):
        built = _built(7)
        built.num_prefills = prefills
        built.num_decodes = 0
        monkeypatch.setattr(
            gdn_reads, "upstream_of", lambda *_, b=built: lambda *a, **k: b
        )
        builder.read_min_tokens = builder_tokens
        metadata = gdn_reads.build(builder, 0, _common(table))
        assert not hasattr(metadata, "read_state_indices")


def test_the_pre_copy_drops_exactly_the_rows_that_read_elsewhere():
    """V2 keeps columns by request slot; rows are batch positions. Each row's
    source column is its last computed token's, its destination the step's
    last token's; a long chunk across an edge loses its copy, everything
    else keeps it (and the builder reads every dropped row elsewhere)."""
    seq_lens = COMPUTED + SCHEDULED
    slots = _i32([6, 5, 4, 3, 2, 1, 0])  # batch row r lives in slot 6 - r
    src = torch.flip((COMPUTED - 1).div(BLOCK, rounding_mode="floor"), [0])
    src = torch.where(torch.flip(COMPUTED, [0]) > 0, src, -1).to(torch.int32)
    dst = torch.flip((seq_lens - 1) // BLOCK, [0]).to(torch.int32)
    bias = torch.zeros(7, dtype=torch.int32)
    tables = (torch.arange(70, dtype=torch.int32).view(7, 10),)  # no shared ids
    long_chunks = SCHEDULED >= MIN_TOKENS
    out = keep_in_place(tables, slots, dst, src, bias, long_chunks)
    copied = [
        row for row in range(7) if out[6 - row] >= 0 and out[6 - row] != dst[6 - row]
    ]
    # row 0 (decode) and row 1 (2 tokens) still copy; rows 2, 3 and 6 cross
    # an edge and read elsewhere; rows 4 (fresh) and 5 have nothing to copy
    assert copied == [0, 1]
    before = keep_in_place(tables, slots, dst, src, bias)
    assert before.ne(dst).logical_and(src >= 0).sum() == 5
    columns = state_reads.read_columns(seq_lens, SCHEDULED, BLOCK, MIN_TOKENS)
    for row in (2, 3, 6):
        assert columns[row] == src[6 - row] != dst[6 - row]


def test_preprocess_state_hands_the_pre_copy_the_query_lengths(monkeypatch):
    seen: list = []
    ctx = SimpleNamespace(pooled_query_lens=None)

    def upstream(model_state, input_batch, *rest):
        seen.append((ctx.pooled_query_lens.tolist(), ctx.pooled_min_tokens))

    monkeypatch.setattr(mamba_copies, "upstream_of", lambda *_: upstream)
    starts = torch.cat((torch.zeros(1, dtype=torch.int32), SCHEDULED.cumsum(0)))
    batch = SimpleNamespace(num_reqs=7, query_start_loc=starts.to(torch.int32))
    state = SimpleNamespace(_mamba_ctx=ctx, read_min_tokens=MIN_TOKENS)
    config = PooledKVCacheConfig(0, [], [])
    mamba_copies.preprocess_state(state, batch, (), config, COMPUTED)
    assert seen == [(SCHEDULED.tolist(), MIN_TOKENS)]
    assert ctx.pooled_query_lens is None
    # an engine whose rows read in place hands nothing over
    state.read_min_tokens = None
    seen.clear()
    monkeypatch.setattr(
        mamba_copies,
        "upstream_of",
        lambda *_: lambda *a: seen.append(ctx.pooled_query_lens),
    )
    mamba_copies.preprocess_state(state, batch, (), config, COMPUTED)
    assert seen == [None]


def test_decode_rows_read_elsewhere_in_a_batch_of_decodes_only():
    """The turn end: a decode crossing into a kept checkpoint's block. In a
    batch of decodes only it reads the old block; with a prefill beside it
    (or a fresh one-token prompt, a prefill for the builder) it is copied."""
    computed, decode = _i32([16, 47, 5]), _i32([1, 1, 1])
    only = state_reads.decode_only_batch(computed, decode)
    assert bool(only)
    assert state_reads.reads_elsewhere(computed, decode, 3, only).tolist() == [True] * 3
    columns = state_reads.read_columns(computed + decode, decode, 16, 3, True)
    assert columns.tolist() == [0, 2, 0]  # the last computed token's column
    # a fresh one-token prompt in the batch: decodes copy again
    fresh = _i32([16, 47, 0])
    assert not bool(state_reads.decode_only_batch(fresh, decode))
    # padded rows (nothing scheduled) do not count
    assert bool(state_reads.decode_only_batch(_i32([16, 0]), _i32([1, 0])))
    mixed = state_reads.reads_elsewhere(_i32([16, 32]), _i32([1, 8]), 3, False)
    assert mixed.tolist() == [False, True]


def test_the_pre_copy_drops_a_turn_end_copy_in_a_decode_only_batch():
    """Slot r holds batch row r. Both rows cross an edge into a fresh block;
    in a batch of decodes only neither copies, with a 2-token chunk beside
    them (a prefill batch) both do."""
    tables = (_i32([[3, 4, 0], [5, 6, 0], [7, 8, 0]]),)
    slots, src = _i32([0, 1, 2]), _i32([0, 0, 0])
    dst, bias = _i32([1, 1, 1]), _i32([0, 0, 0])
    ctx = SimpleNamespace(pooled_reads_elsewhere=True, pooled_min_tokens=3)
    ctx.pooled_query_lens = _i32([1, 1, 1])
    rows = mamba_copies._rows_reading_elsewhere(ctx, slots, src)
    assert keep_in_place(tables, slots, dst, src, bias, rows).tolist() == [1, 1, 1]
    ctx.pooled_query_lens = _i32([1, 1, 2])
    rows = mamba_copies._rows_reading_elsewhere(ctx, slots, src)
    assert keep_in_place(tables, slots, dst, src, bias, rows).tolist() == [0, 0, 0]
    # not every core reads out of place: nothing is dropped
    ctx.pooled_reads_elsewhere = False
    assert mamba_copies._rows_reading_elsewhere(ctx, slots, src) is None


def test_a_decode_batch_replayed_by_cuda_graphs_gets_a_padded_read_buffer(
    monkeypatch,
):
    """Full CUDA graphs read the write ids from the builder's buffer; the
    read ids go to a buffer of the same shape, padded with the null block."""
    persistent = torch.full((6,), -7, dtype=torch.int32)
    built = SimpleNamespace(
        num_prefills=0,
        num_decodes=2,
        spec_sequence_masks=None,
        non_spec_state_indices_tensor=persistent[:4],
    )
    monkeypatch.setattr(gdn_reads, "upstream_of", lambda *_: lambda *a, **k: built)
    builder = SimpleNamespace(
        read_min_tokens=MIN_TOKENS,
        kv_cache_spec=SimpleNamespace(block_size=BLOCK),
        non_spec_state_indices_tensor=persistent,
    )
    table = torch.arange(20, dtype=torch.int32).view(2, 10) + 100
    common = SimpleNamespace(
        num_reqs=2,
        query_start_loc=_i32([0, 1, 2]),
        seq_lens=_i32([17, 40]),  # row 0 crosses into column 1, row 1 does not
        block_table_tensor=table,
    )
    metadata = gdn_reads.build(builder, 0, common)
    assert metadata.read_state_indices.tolist() == [100, 112, 0, 0]
    buffer = builder.read_state_indices_buffer
    assert buffer.shape == persistent.shape
    assert metadata.read_state_indices.data_ptr() == buffer.data_ptr()


def test_the_pre_copy_drops_long_chunks_only_where_every_core_reads_them():
    spec = MambaSpec(
        block_size=16, shapes=((3, 64), (4, 16, 16)), dtypes=(torch.bfloat16,) * 2
    )
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    config = PooledKVCacheConfig(0, [], [KVCacheGroupSpec(["a", "b"], spec)])
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    qwen = object.__new__(QwenGatedDeltaNetAttention)
    assert mamba_copies._cores_read_elsewhere(config, {"a": qwen, "b": qwen})
    assert not mamba_copies._cores_read_elsewhere(config, {"a": qwen, "b": object()})
    assert not mamba_copies._cores_read_elsewhere(PooledKVCacheConfig(0, [], []), {})


def test_the_replacements_take_upstreams_parameters():
    import inspect

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    from vllm_hybrid.model_executor.layers.mamba import gdn_out_of_place
    from vllm_hybrid.patches.registry import upstream

    pairs = (
        (gdn_out_of_place.forward_core, QwenGatedDeltaNetAttention, "_forward_core"),
        (
            gdn_reads.update_block_table,
            GDNAttentionMetadataBuilder,
            "update_block_table",
        ),
        (mamba_copies.preprocess_state, MambaHybridModelState, "preprocess_state"),
    )
    for ours, cls, name in pairs:
        target = f"{cls.__module__}:{cls.__name__}.{name}"
        theirs = inspect.signature(upstream(target)).parameters
        assert list(inspect.signature(ours).parameters) == list(theirs), name
