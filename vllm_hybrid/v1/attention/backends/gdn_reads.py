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
new table. A batch of decodes only that full CUDA graphs replay has its
write ids in a buffer of the builder's; its read ids go to a second buffer
of the same shape (``read_state_indices_buffer``), which the captured layer
reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.worker.state_reads import (
    read_columns,
    read_state_ids,
    reads_out_of_place,
    spec_min_chunk_tokens,
)

if TYPE_CHECKING:
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAttentionMetadata,
        GDNAttentionMetadataBuilder,
    )


def _min_tokens(builder: GDNAttentionMetadataBuilder) -> int | None:
    """The builder's shortest out-of-place chunk, or None where its rows
    read in place; decided once per builder from its config."""
    cached = builder.__dict__.get("read_min_tokens", False)
    if cached is not False:
        return cached
    tokens = None
    if reads_out_of_place(builder.vllm_config):
        tokens = spec_min_chunk_tokens(builder.kv_cache_spec)
    builder.read_min_tokens = tokens
    return tokens


def build(
    self: GDNAttentionMetadataBuilder,
    common_prefix_len: int,
    common_attn_metadata: Any,
    *args: Any,
    **kw: Any,
) -> Any:
    """Upstream's build, plus the read blocks of a batch without speculative
    rows (prefill chunks, or a batch of decodes only)."""
    metadata = upstream_of(__name__, "build")(
        self, common_prefix_len, common_attn_metadata, *args, **kw
    )
    if metadata.spec_sequence_masks is not None:
        return metadata
    if metadata.num_prefills == 0 and metadata.num_decodes == 0:
        return metadata
    min_tokens = _min_tokens(self)
    if min_tokens is None:
        return metadata
    m = common_attn_metadata
    rows = m.num_reqs
    starts = m.query_start_loc[: rows + 1]
    columns = read_columns(
        m.seq_lens[:rows],
        starts[1:] - starts[:-1],
        self.kv_cache_spec.block_size,
        min_tokens,
        decode_only=metadata.num_prefills == 0,
    )
    metadata.read_state_columns = columns
    ids = read_state_ids(m.block_table_tensor, columns)
    metadata.read_state_indices = _staged(self, metadata, ids)
    return metadata


def update_block_table(
    self: GDNAttentionMetadataBuilder, metadata: Any, blk_table: Any, slot_mapping: Any
) -> Any:
    """Upstream's re-gather for another state group, the read blocks too."""
    updated = upstream_of(__name__, "update_block_table")(
        self, metadata, blk_table, slot_mapping
    )
    columns = getattr(metadata, "read_state_columns", None)
    if columns is not None:
        updated.read_state_columns = columns
        ids = read_state_ids(blk_table, columns)
        updated.read_state_indices = _staged(self, updated, ids)
    return updated


def _staged(
    builder: GDNAttentionMetadataBuilder,
    metadata: GDNAttentionMetadata,
    ids: torch.Tensor,
) -> torch.Tensor:
    """``ids`` where the layer will read them: for a batch whose write ids
    sit in the builder's full-CUDA-graph buffer (decodes only), a buffer of
    the builder's own beside it, padded as upstream pads the write ids (the
    null block, which the kernels skip); else ``ids`` themselves."""
    write = metadata.non_spec_state_indices_tensor
    persistent = builder.non_spec_state_indices_tensor
    if write is None or write.data_ptr() != persistent.data_ptr():
        return ids
    buffer = builder.__dict__.get("read_state_indices_buffer")
    if buffer is None:
        buffer = torch.zeros_like(persistent)
        builder.read_state_indices_buffer = buffer
    rows = metadata.num_decodes
    buffer[:rows].copy_(ids[:rows], non_blocking=True)
    staged = buffer[: write.shape[0]]
    staged[rows:].fill_(NULL_BLOCK_ID)
    return staged
