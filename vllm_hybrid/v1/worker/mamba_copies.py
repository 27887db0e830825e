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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_hybrid.patches.registry import upstream_of

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


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
