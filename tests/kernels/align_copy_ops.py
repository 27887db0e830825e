"""Align mode's state copies at a block edge, as the V1 worker issues them.

When a request crosses a ``mamba_block_size`` edge, ``preprocess_mamba``
(``vllm/v1/worker/mamba_utils.py``) copies its running state from the old
block column to the new one before the forward pass. Two upstream paths,
both driven by byte addresses taken from the bound state views:

* without speculative decoding:
  ``collect_mamba_copy_meta`` turns each (layer, state) into a source
  address, destination address and size via the copy specs, and
  ``do_mamba_copy_block`` runs ``batch_memcpy_kernel`` over them;
* with speculative decoding: ``MambaSpecDecodeGPUContext`` records each
  state tensor's base address, block stride and sizes
  (``_populate_metadata``), and ``run_fused_precopy`` launches
  ``precopy_mamba_align_fused_kernel`` with the per-request block-table rows
  and source/destination columns (plus the accepted-token bias).

A :class:`Crossing` is one request's copy: its block-table row (state ids per
column) and the columns. The short-memory path of pooled mode, which lends a
request the block it already owns, is a crossing whose two columns hold the
same id: a copy onto itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from arena_views import DEVICE, ArenaViews
from state_check import state_spec_of
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils

from vllm_hybrid.v1.core.pooled.spec import PoolKind


@dataclass(frozen=True)
class Crossing:
    """One request's block-edge copy: ``row[src_col] -> row[dst_col]``
    (temporal state from ``row[src_col + bias]``, conv state shifted by
    ``bias`` tokens; ``bias`` is ``num_accepted_tokens - 1``)."""

    row: tuple[int, ...]
    src_col: int
    dst_col: int
    bias: int = 0


def copy_funcs(arena: ArenaViews) -> dict:
    """The state copy specs the model registers (conv, temporal)."""
    spec = state_spec_of(arena)
    return {
        spec.mamba_type: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
    }


def _make_buffer(*size: int, dtype: torch.dtype) -> CpuGpuBuffer:
    return CpuGpuBuffer(*size, dtype=dtype, device=DEVICE, pin_memory=False)


def _forward_context(states: Mapping[str, tuple[torch.Tensor, ...]]) -> dict:
    return {name: SimpleNamespace(kv_cache=list(kv)) for name, kv in states.items()}


def batch_memcpy_copy(
    arena: ArenaViews,
    states: Mapping[str, tuple[torch.Tensor, ...]],
    crossings: Sequence[Crossing],
) -> torch.Tensor:
    """The non-speculative path: copy metadata per request, then one
    ``batch_memcpy`` launch. Every state layer of the arena must be in
    ``states`` (the metadata covers the whole mamba group)."""
    bufs = copy_buffers(arena, states, crossings)
    mamba_utils.do_mamba_copy_block(bufs)
    return bufs.sizes.cpu[: bufs.offset].clone()


def copy_buffers(
    arena: ArenaViews,
    states: Mapping[str, tuple[torch.Tensor, ...]],
    crossings: Sequence[Crossing],
) -> mamba_utils.MambaCopyBuffers:
    """The copy metadata ``preprocess_mamba`` collects for ``crossings``
    (source, destination and size of each layer's states), ready for
    ``do_mamba_copy_block``."""
    config, funcs = arena.config, copy_funcs(arena)
    bufs = mamba_utils.MambaCopyBuffers.create(
        len(crossings), config, funcs, _make_buffer
    )
    group = config.pool_by_kind(PoolKind.STATE).group_ids[0]
    context = _forward_context(states)
    for c in crossings:
        block_ids = {group: list(c.row)}
        mamba_utils.collect_mamba_copy_meta(
            bufs,
            config,
            funcs,
            bufs.mamba_group_ids,
            c.src_col,
            c.dst_col,
            c.bias,
            SimpleNamespace(block_ids=block_ids),
            context,
        )
    return bufs


def spec_decode_context(
    arena: ArenaViews,
    states: Mapping[str, tuple[torch.Tensor, ...]],
    rows: Sequence[Sequence[int]],
    *,
    config: KVCacheConfig | None = None,
    initialize: Callable[..., None] | None = None,
):
    """Upstream's speculative-decoding copy context over the bound views,
    with one block-table row (state ids per column) per request, and that
    table: the context keeps only its address, so the caller must hold it
    while the kernels run. ``config`` replaces the arena's pooled config and
    ``initialize`` upstream's ``initialize_from_forward_context`` (called
    with the context first), for the overlay's replacement of it."""
    funcs = copy_funcs(arena)
    config = arena.config if config is None else config
    if initialize is None:
        initialize = (
            mamba_utils.MambaSpecDecodeGPUContext.initialize_from_forward_context
        )
    n = len(rows)
    ctx = mamba_utils.MambaSpecDecodeGPUContext.create(
        n, config, funcs, DEVICE, _make_buffer
    )
    table = torch.zeros(
        (n, max(len(r) for r in rows)), dtype=torch.int32, device=DEVICE
    )
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    initialize(ctx, config, _forward_context(states), funcs, [table])
    return ctx, table


def _column(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def fused_precopy(
    arena: ArenaViews,
    states: Mapping[str, tuple[torch.Tensor, ...]],
    crossings: Sequence[Crossing],
) -> torch.Tensor:
    """The speculative-decoding path: layout metadata from the bound views,
    then ``precopy_mamba_align_fused_kernel`` over the batch."""
    ctx, _table = spec_decode_context(arena, states, [c.row for c in crossings])
    ctx.run_fused_precopy(
        num_reqs=len(crossings),
        state_idx_gpu=_column([c.dst_col for c in crossings]),
        src_col_gpu=_column([c.src_col for c in crossings]),
        token_bias_gpu=_column([c.bias for c in crossings]),
        idx_mapping=None,
    )
    sizes = [ctx.state_inner_sizes, ctx.state_elem_sizes, ctx.state_conv_widths]
    return torch.stack([s.long() for s in sizes]).cpu()


@dataclass(frozen=True)
class Step:
    """One request's post-step bookkeeping for ``postprocess_mamba_fused_kernel``:
    tokens computed before the step, scheduled in it (1 + drafts), drafts,
    tokens accepted, and the column its running state is in."""

    row: tuple[int, ...]
    computed: int
    scheduled: int
    drafts: int
    accepted: int
    state_col: int


def fused_postprocess(
    arena: ArenaViews,
    states: Mapping[str, tuple[torch.Tensor, ...]],
    steps: Sequence[Step],
) -> torch.Tensor:
    """Speculative decoding after the forward pass: the state of the last
    accepted token is saved at the block edge it reached. Returns the
    accepted-token counts the kernel leaves for the next step."""
    n = len(steps)
    ctx, _table = spec_decode_context(arena, states, [s.row for s in steps])
    accepted = _column([s.accepted for s in steps])
    ctx.num_accepted_tokens_out[:n].copy_(accepted)
    ctx.run_fused_postprocess(
        num_reqs=n,
        num_accepted_tokens_gpu=accepted,
        mamba_state_idx_gpu=_column([s.state_col for s in steps]),
        num_scheduled_tokens_gpu=_column([s.scheduled for s in steps]),
        num_computed_tokens_gpu=_column([s.computed for s in steps]),
        num_draft_tokens_gpu=_column([s.drafts for s in steps]),
    )
    return ctx.num_accepted_tokens_out[:n].cpu().clone()
