"""Align mode's state copies: none where a request's two columns are one block.

Before each forward pass the V1 model runner (``preprocess_mamba``) copies a
request's recurrent state from the block column of its previous step to the
column it writes now, whenever the two columns differ. Pooled mode lets a
decoding request cross a state block edge in place: the column it enters
names the very block it leaves (see ``PooledCoordinatorMixin`` in
:mod:`vllm_hybrid.v1.core.pooled.coordinator`). Upstream would still queue
that copy, the whole state onto itself: bandwidth for nothing, and host time
to build the copy list (about 0.35 ms per copied request on an H200,
benchmarks/results/gpu-20261127/copies.json).

:func:`collect_mamba_copy_meta` skips such a copy and hands every other one to
upstream's function unchanged. A copy is skipped only when it would move no
byte: no accepted-token shift (a shift moves a conv window within a block)
and the same block in both columns of every state group.

Model Runner V2 makes no copy list: each step it records, on the GPU, the
column every request leaves and the bias, then launches one fused pre-copy
kernel (``MambaSpecDecodeGPUContext.run_fused_precopy``) that copies wherever
the two columns differ, a block onto itself included: a real read and write
of the whole state (about 0.033 ms per request on an H200, some 16 requests
a step at 256 decoding). The kernel makes no copy for a source column equal
to the destination column, so on a pooled config :func:`run_fused_precopy`
hands it source columns in which each copy of a block onto itself (same
rule as above) names its destination column (:func:`keep_in_place`),
computed with torch ops on the device: V2 schedules asynchronously and must
not wait for the host. The block tables it compares come from
:func:`initialize_from_forward_context`, which keeps them on pooled configs
only, so other configs launch upstream's kernel with upstream's tensors.

On engines whose steps read their state out of place
(:mod:`vllm_hybrid.v1.worker.state_reads`: prefill chunks long enough, and
the rows of a batch of decodes only), the pre-copy also drops those rows'
copies: :func:`preprocess_state` hands it the rows' scheduled tokens, and
the layer reads their source block itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.worker.state_reads import (
    copy_free_chunk_tokens,
    decode_only_batch,
    reads_elsewhere,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
    from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext


def is_self_copy(
    block_ids: Any, group_ids: Any, src_column: int, dst_column: int, bias: int
) -> bool:
    """Whether copying every state group's ``src_column`` to ``dst_column``
    (with accepted-token bias ``bias``) would write each block onto itself."""
    if bias != 0:
        return False
    for group_id in group_ids:
        blocks = block_ids[group_id]
        if blocks[src_column] != blocks[dst_column]:
            return False
    return True


def collect_mamba_copy_meta(
    copy_bufs: Any,
    kv_cache_config: KVCacheConfig,
    mamba_state_copy_funcs: Any,
    mamba_group_ids: Any,
    src_block_idx: int,
    dest_block_idx: int,
    accept_token_bias: int,
    req_state: Any,
    forward_context: Any,
) -> None:
    """Upstream's copy-list collection, less the copies of a block onto
    itself (module docstring)."""
    if is_self_copy(
        req_state.block_ids,
        mamba_group_ids,
        src_block_idx,
        dest_block_idx,
        accept_token_bias,
    ):
        return
    upstream_of(__name__, "collect_mamba_copy_meta")(
        copy_bufs,
        kv_cache_config,
        mamba_state_copy_funcs,
        mamba_group_ids,
        src_block_idx,
        dest_block_idx,
        accept_token_bias,
        req_state,
        forward_context,
    )


# -- Model Runner V2: the fused pre-copy ---------------------------------------


def keep_in_place(
    state_tables: Sequence[torch.Tensor],
    slots: torch.Tensor,
    dst_cols: torch.Tensor,
    src_cols: torch.Tensor,
    biases: torch.Tensor,
    reads_elsewhere: torch.Tensor | None = None,
) -> torch.Tensor:
    """``src_cols`` with the columns of copies onto themselves set to the
    destination column, which the pre-copy kernel takes for "no copy";
    likewise the copies of the rows flagged in ``reads_elsewhere`` (by batch
    row), whose step reads the source block itself
    (:mod:`vllm_hybrid.v1.worker.state_reads`).

    ``slots`` are the batch's request slots (V2's ``idx_mapping``; -1 is a
    row to leave out); ``dst_cols``, ``src_cols`` and ``biases`` are indexed
    by slot, as are the rows of every state group's block table in
    ``state_tables``. A slot's copy is dropped when it is one (a source
    column, other than its destination), has no accepted-token bias and
    both columns name the same block in every table. Torch ops only, on the
    tensors' device: nothing is read back to the host, which V2's
    asynchronous scheduling relies on. ``src_cols`` itself is not written.
    """
    valid = slots >= 0
    rows = slots.clamp(min=0).long()
    src = src_cols[rows].long()
    dst = dst_cols[rows].long()
    width = min(table.shape[1] for table in state_tables)
    skip = (
        valid
        & (src >= 0)
        & (src != dst)
        & (dst < width)
        & (src < width)
        & (biases[rows] == 0)
    )
    src_in, dst_in = src.clamp(0, width - 1), dst.clamp(0, width - 1)
    same = torch.ones_like(skip)
    for table in state_tables:
        same &= table[rows, src_in] == table[rows, dst_in]
    skip &= same if reads_elsewhere is None else same | reads_elsewhere
    # per slot, whether any of its rows is dropped: a max over the rows
    # gives the same answer for a slot listed twice (or a left-out row
    # clamped onto slot 0), whatever order the writes land in
    dropped = torch.zeros_like(src_cols)
    dropped.scatter_reduce_(0, rows, skip.to(src_cols.dtype), reduce="amax")
    return torch.where(dropped > 0, dst_cols, src_cols)


def initialize_from_forward_context(
    self: MambaSpecDecodeGPUContext,
    kv_cache_config: KVCacheConfig,
    forward_context: dict[str, Any],
    mamba_state_copy_funcs: Any,
    block_tables: list[torch.Tensor],
    aligned_index_block_tables: list[torch.Tensor] | None = None,
) -> None:
    """Upstream's set-up of the state-copy context; on a pooled config it
    also keeps the state groups' block tables (indexed by request slot) for
    :func:`run_fused_precopy`, which upstream keeps as addresses only.
    Upstream sets a context up once and ignores later calls; so does this,
    so the tables kept are always those whose addresses the kernel reads."""
    first = not getattr(self, "is_initialized", False)
    upstream_of(__name__, "initialize_from_forward_context")(
        self,
        kv_cache_config,
        forward_context,
        mamba_state_copy_funcs,
        block_tables,
        aligned_index_block_tables,
    )
    if first and isinstance(kv_cache_config, PooledKVCacheConfig):
        self.pooled_state_tables = tuple(block_tables)
        self.pooled_reads_elsewhere = _cores_read_elsewhere(
            kv_cache_config, forward_context
        )


def _cores_read_elsewhere(
    kv_cache_config: KVCacheConfig, forward_context: dict[str, Any]
) -> bool:
    """Whether every state layer's core reads prefill states out of place
    (:mod:`vllm_hybrid.model_executor.layers.mamba.gdn_out_of_place`): only
    then may the pre-copy drop the copies of such rows."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    names = [
        name
        for group in kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
        for name in group.layer_names
    ]
    return bool(names) and all(
        isinstance(forward_context.get(name), QwenGatedDeltaNetAttention)
        for name in names
    )


def run_fused_precopy(
    self: MambaSpecDecodeGPUContext,
    num_reqs: int,
    state_idx_gpu: torch.Tensor,
    src_col_gpu: torch.Tensor,
    token_bias_gpu: torch.Tensor,
    idx_mapping: torch.Tensor | None,
) -> None:
    """Upstream's pre-copy launch, handed source columns without the copies
    of a block onto itself (:func:`keep_in_place`) on a pooled config.

    Only V2 passes ``idx_mapping``. V1's fused path (speculative decoding)
    is left alone: the tables it registers are slices sized to its first
    batch, and with speculative blocks pooled mode never crosses in place.
    """
    tables = getattr(self, "pooled_state_tables", None)
    if tables and idx_mapping is not None and num_reqs > 0:
        slots = idx_mapping[:num_reqs]
        src_col_gpu = keep_in_place(
            tables,
            slots,
            state_idx_gpu,
            src_col_gpu,
            token_bias_gpu,
            _rows_reading_elsewhere(self, slots, src_col_gpu),
        )
    upstream_of(__name__, "run_fused_precopy")(
        self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping
    )


def _rows_reading_elsewhere(
    ctx: Any, slots: torch.Tensor, src_cols: torch.Tensor
) -> torch.Tensor | None:
    """Per batch row, whether the step reads its state in the source block
    itself (:func:`~vllm_hybrid.v1.worker.state_reads.reads_elsewhere`, the
    metadata builder's rule; a source column of -1 is a row with nothing
    computed), or None where this engine's rows never do."""
    query_lens = getattr(ctx, "pooled_query_lens", None)
    if query_lens is None or not getattr(ctx, "pooled_reads_elsewhere", False):
        return None
    query_lens = query_lens[: slots.shape[0]]
    computed = (src_cols[slots.clamp(min=0).long()] >= 0) & (slots >= 0)
    decode_only = decode_only_batch(computed, query_lens)
    return reads_elsewhere(computed, query_lens, ctx.pooled_min_tokens, decode_only)


def preprocess_state(
    self: MambaHybridModelState,
    input_batch: Any,
    block_tables: Any,
    kv_cache_config: KVCacheConfig,
    num_computed_tokens: torch.Tensor,
) -> None:
    """Model Runner V2's state pre-processing, handing the pre-copy each
    batch row's scheduled tokens (``pooled_query_lens``, on the device) and
    the shortest chunk that reads out of place (``pooled_min_tokens``) when
    this engine's rows read out of place
    (:func:`~vllm_hybrid.v1.worker.state_reads.copy_free_chunk_tokens`)."""
    ctx = getattr(self, "_mamba_ctx", None)
    min_tokens = _min_chunk_tokens(self, kv_cache_config)
    if ctx is not None and min_tokens is not None and input_batch.num_reqs > 0:
        starts = input_batch.query_start_loc[: input_batch.num_reqs + 1]
        ctx.pooled_query_lens = starts[1:] - starts[:-1]
        ctx.pooled_min_tokens = min_tokens
    try:
        upstream_of(__name__, "preprocess_state")(
            self, input_batch, block_tables, kv_cache_config, num_computed_tokens
        )
    finally:
        if ctx is not None:
            ctx.pooled_query_lens = None


def _min_chunk_tokens(
    model_state: MambaHybridModelState, kv_cache_config: KVCacheConfig
) -> int | None:
    """The shortest chunk whose copy this runner drops, or None; decided once
    per model state."""
    cached = model_state.__dict__.get("read_min_tokens", False)
    if cached is not False:
        return cached
    tokens = copy_free_chunk_tokens(model_state.vllm_config, kv_cache_config)
    model_state.read_min_tokens = tokens
    return tokens
