"""The gated-DeltaNet metadata builder, also naming the block each prefill
row reads its state from (:mod:`vllm_hybrid.v1.worker.state_reads`).

Upstream's builder gives the layer one state block per row, the one the
step ends in. On engines whose prefill chunks read out of place, the built
metadata also carries ``read_state_columns`` (per non-speculative row, the
block column read, :func:`~vllm_hybrid.v1.worker.state_reads.read_columns`)
and ``read_state_indices`` (that column's block id in this group's table).
Both runners build one group's metadata and re-gather the state ids for the
other state groups with ``update_block_table``; the columns are the same for
every group, so the re-gather takes them along and looks the ids up in the
new table.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.worker.state_reads import (
    min_chunk_tokens,
    read_columns,
    read_state_ids,
    reads_out_of_place,
)


def _min_tokens(builder: Any) -> int | None:
    """The builder's shortest out-of-place chunk, or None where prefill rows
    read in place; decided once per builder from its config."""
    cached = builder.__dict__.get("read_min_tokens", False)
    if cached is not False:
        return cached
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    tokens = None
    if reads_out_of_place(builder.vllm_config):
        conv_shape = tuple(builder.kv_cache_spec.shapes[0])
        tokens = min_chunk_tokens(conv_shape, is_conv_state_dim_first())
    builder.read_min_tokens = tokens
    return tokens


def build(
    self: Any, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kw: Any
) -> Any:
    """Upstream's build, plus the read blocks of a batch with prefills."""
    metadata = upstream_of(__name__, "build")(
        self, common_prefix_len, common_attn_metadata, *args, **kw
    )
    if metadata.num_prefills == 0 or metadata.spec_sequence_masks is not None:
        return metadata
    min_tokens = _min_tokens(self)
    if min_tokens is None:
        return metadata
    m = common_attn_metadata
    rows = metadata.non_spec_state_indices_tensor.shape[0]
    starts = m.query_start_loc[: rows + 1]
    columns = read_columns(
        m.seq_lens[:rows],
        starts[1:] - starts[:-1],
        self.kv_cache_spec.block_size,
        min_tokens,
    )
    metadata.read_state_columns = columns
    metadata.read_state_indices = read_state_ids(m.block_table_tensor, columns)
    return metadata


def update_block_table(
    self: Any, metadata: Any, blk_table: Any, slot_mapping: Any
) -> Any:
    """Upstream's re-gather for another state group, the read blocks too."""
    updated = upstream_of(__name__, "update_block_table")(
        self, metadata, blk_table, slot_mapping
    )
    columns = getattr(metadata, "read_state_columns", None)
    if columns is not None:
        updated.read_state_columns = columns
        updated.read_state_indices = read_state_ids(blk_table, columns)
    return updated
