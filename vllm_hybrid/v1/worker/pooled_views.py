"""What a worker's pooled KV cache views must satisfy, checked where it matters.

Two concerns, both about the per-layer tensors upstream's
``allocate_kv_cache`` builds from a :class:`PooledKVCacheConfig`:

* **Kernel blocks.** A pooled token block holds one page of every attention
  layer side by side (the token tensor's block stride is the sum of the
  aligned pages). Upstream can only split a manager block into smaller kernel
  blocks when a block is one dense page, so the attention backend must run
  the block size as it is. Where it cannot, the worker would fail while
  binding its caches, with advice that does not apply to pooled mode (a
  layer-compact layout changes nothing here: pooled mode fixes the layer and
  block strides itself). :func:`check_kernel_blocks` refuses that
  configuration when the worker aligns its block size, before any profiling
  or allocation, naming the backend and what to change.

* **Disjoint views.** Every layer's view of every block a pool owns must stay
  inside the arena and must not share a byte with any other layer's owned
  blocks, in either pool, wherever the boundary stands; with CUDA graphs the
  null blocks (which padded state slots write to) must not touch owned blocks
  either. :func:`check_pooled_views` computes the byte runs of each view from
  its strides (no memory is read, so ``meta`` tensors work) and reports the
  first violation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

#: How pooled mode is switched off, for error messages.
POOLED_OFF = """--additional-config '{"hybrid_kv": {"pooled": false}}'"""


class PooledViewError(ValueError):
    """A pooled KV cache view the worker cannot use; names the fix."""


# ---------------------------------------------------------------------------
# Kernel blocks
# ---------------------------------------------------------------------------


def _describe_sizes(sizes: Sequence[Any]) -> str:
    return ", ".join(
        str(size) if isinstance(size, int) else f"any multiple of {size.base}"
        for size in sizes
    )


def kernel_block_error(
    backend: type[AttentionBackend], spec: AttentionSpec
) -> str | None:
    """Why ``backend`` cannot serve pooled token blocks of ``spec``, or None.

    Upstream splits a block into kernel blocks only where a block is one
    dense page (``prepare_kernel_block_sizes``, ``create_kv_cache_views``).
    A pooled token block holds every attention layer's page side by side,
    so the block must be a kernel block size of the backend as it is. The
    test is upstream's own choice of kernel block
    (``select_common_block_size``), which each metadata builder repeats.
    """
    from vllm.v1.worker.utils import customize_attention_spec, select_common_block_size

    spec = customize_attention_spec(backend, spec)
    block = spec.block_size
    try:
        chosen = select_common_block_size(block, [backend], [spec])
    except ValueError:
        chosen = None
    if chosen == block:
        return None
    sizes = backend.get_supported_kernel_block_sizes(spec)
    return (
        f"vllm-hybrid pooled KV mode keeps the attention block at {block} tokens "
        "and stores the pages of all attention layers of a block side by side, "
        "so a block is never split into kernel blocks (with every KV cache "
        "layout: VLLM_KV_CACHE_LAYOUT does not change this); attention backend "
        f"{backend.get_name()} runs kernel blocks of {_describe_sizes(sizes)} "
        "tokens. Set --block-size to one of those, or use upstream's single KV "
        f"pool with {POOLED_OFF}."
    )


def kv_cache_torch_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The torch dtype of the attention KV cache (the model's for "auto")."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        return vllm_config.model_config.dtype
    return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


def attention_spec_of(vllm_config: VllmConfig) -> FullAttentionSpec:
    """The attention layers' spec as their ``get_kv_cache_spec`` builds it
    (before the backend customizes it), from the config alone."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    return FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model.get_head_size(),
        dtype=kv_cache_torch_dtype(vllm_config),
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
    )


def check_kernel_blocks(
    vllm_config: VllmConfig, backends: Iterable[type[AttentionBackend]]
) -> None:
    """Refuse a block size the attention backends cannot run unsplit.

    Runs in every worker when pooled mode fixes the block size (the
    platform's hybrid block alignment), before specs, profiling and
    allocation: upstream's CUDA-graph memory profiling already builds kernel
    block tables for this block.
    """
    spec = attention_spec_of(vllm_config)
    for backend in backends:
        error = kernel_block_error(backend, spec)
        if error is not None:
            raise PooledViewError(error)


# ---------------------------------------------------------------------------
# Byte runs of views
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ViewRuns:
    """Where one layer's view puts each block: ``offsets[k] + b * block_stride``
    starts a run of ``run_bytes`` bytes, for every ``k``."""

    layer: str
    block_stride: int
    offsets: np.ndarray
    run_bytes: int
    num_blocks: int

    def runs(self, ids: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, block ids)`` of every run of the blocks ``ids``."""
        block_ids = np.asarray(ids, dtype=np.int64)
        starts = block_ids[:, None] * self.block_stride + self.offsets[None, :]
        owners = np.repeat(block_ids, len(self.offsets))
        return starts.reshape(-1), owners

    @property
    def extent(self) -> tuple[int, int]:
        """First and one-past-last byte any block id of the view can touch."""
        first = int(self.offsets.min())
        last = (self.num_blocks - 1) * self.block_stride + int(self.offsets.max())
        return min(first, last), max(first, last) + self.run_bytes


def view_runs(layer: str, view: torch.Tensor, max_runs: int = 4096) -> ViewRuns:
    """The byte runs of ``view`` (blocks on dim 0), from its strides.

    The dims inside a block are taken in memory order (the set of bytes does
    not depend on the logical order) and merged into one run while they are
    contiguous; the dims outside that run (a head dim outside the block dim,
    for instance) give several runs per block.
    """
    size = view.element_size()
    dims = sorted(
        zip(view.shape[1:], (s * size for s in view.stride()[1:]), strict=True),
        key=lambda dim: dim[1],
        reverse=True,
    )
    shape, strides = [d[0] for d in dims], [d[1] for d in dims]
    run = size
    while shape and (shape[-1] == 1 or strides[-1] == run):
        run *= shape.pop()
        strides.pop()
    count = int(np.prod(shape)) if shape else 1
    if count > max_runs:
        raise PooledViewError(
            f"{layer}: view {tuple(view.shape)} with strides {view.stride()} has "
            f"{count} runs per block; too fragmented to check"
        )
    offsets = np.zeros(1, dtype=np.int64)
    for extent, stride in zip(shape, strides, strict=True):
        steps = np.arange(extent, dtype=np.int64) * stride
        offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
    return ViewRuns(
        layer=layer,
        block_stride=view.stride(0) * size,
        offsets=offsets + view.storage_offset() * size,
        run_bytes=run,
        num_blocks=view.shape[0],
    )


# ---------------------------------------------------------------------------
# Pooled views: inside the arena, disjoint at every boundary
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FloorCheck:
    """What was checked with the state pool starting at ``state_floor``."""

    state_floor: int
    token_ids: range
    state_ids: range
    #: Runs of owned blocks checked for overlap (all layers, both pools).
    owned_runs: int
    #: Runs of null blocks checked against them (0 where nulls may overlap).
    null_runs: int


@dataclass(frozen=True)
class _Runs:
    """Byte runs ``[starts, ends)``; run ``k`` is block ``blocks[k]`` of
    ``views[view_index[k]]`` (names are built only for an error message)."""

    starts: np.ndarray
    ends: np.ndarray
    view_index: np.ndarray
    blocks: np.ndarray
    views: list[tuple[PoolKind, str]]

    def label(self, k: int) -> str:
        kind, layer = self.views[int(self.view_index[k])]
        return (
            f"{kind} block {int(self.blocks[k])} of {layer} "
            f"[{int(self.starts[k])}, {int(self.ends[k])})"
        )


def boundary_floors(layout: ArenaLayout) -> tuple[int, ...]:
    """State floors worth checking: both extremes, the initial one, and the
    neighbours of the extremes (where off-by-one errors live)."""
    lo, hi = layout.min_state_floor, layout.max_state_floor
    picks = {lo, hi, layout.initial_state_floor, min(lo + 1, hi), max(hi - 1, lo)}
    return tuple(sorted(picks))


def _pool_views(
    config: PooledKVCacheConfig, kv_caches: Mapping[str, torch.Tensor]
) -> dict[PoolKind, list[ViewRuns]]:
    views: dict[PoolKind, list[ViewRuns]] = {}
    for pool in config.pools:
        layers = [
            name
            for gid in pool.group_ids
            for name in config.kv_cache_groups[gid].layer_names
        ]
        views[pool.kind] = [view_runs(name, kv_caches[name]) for name in layers]
        for runs in views[pool.kind]:
            if runs.num_blocks != pool.num_blocks:
                raise PooledViewError(
                    f"{runs.layer}: view has {runs.num_blocks} blocks, the "
                    f"{pool.kind} pool {pool.num_blocks}"
                )
    return views


def _check_inside(views: dict[PoolKind, list[ViewRuns]], arena_bytes: int) -> None:
    for kind, pool_views in views.items():
        for runs in pool_views:
            first, end = runs.extent
            if first < 0 or end > arena_bytes:
                raise PooledViewError(
                    f"{kind} pool view of {runs.layer} spans bytes [{first}, {end}) "
                    f"outside the arena of {arena_bytes} B"
                )


def _collect(
    views: dict[PoolKind, list[ViewRuns]], ids: Mapping[PoolKind, Sequence[int]]
) -> _Runs:
    starts, ends, view_index, blocks = [], [], [], []
    names: list[tuple[PoolKind, str]] = []
    for kind, pool_views in views.items():
        for runs in pool_views:
            s, owners = runs.runs(ids[kind])
            starts.append(s)
            ends.append(s + runs.run_bytes)
            view_index.append(np.full(len(s), len(names), dtype=np.int64))
            blocks.append(owners)
            names.append((kind, runs.layer))
    empty = np.zeros(0, dtype=np.int64)
    return _Runs(
        np.concatenate([empty, *starts]),
        np.concatenate([empty, *ends]),
        np.concatenate([empty, *view_index]),
        np.concatenate([empty, *blocks]),
        names,
    )


def _first_overlap(owned: _Runs) -> str | None:
    order = np.argsort(owned.starts, kind="stable")
    starts, ends = owned.starts[order], owned.ends[order]
    if len(starts) < 2:
        return None
    reach = np.maximum.accumulate(ends)
    clash = np.nonzero(starts[1:] < reach[:-1])[0]
    if not len(clash):
        return None
    i = int(clash[0]) + 1
    j = int(np.argmax(ends[:i] > starts[i]))
    return f"{owned.label(order[j])} overlaps {owned.label(order[i])}"


def _null_clash(owned: _Runs, nulls: _Runs) -> str | None:
    if not len(owned.starts):
        return None
    order = np.argsort(owned.starts, kind="stable")
    starts, ends = owned.starts[order], owned.ends[order]
    # owned runs are disjoint here, so their ends are sorted too
    first = np.searchsorted(ends, nulls.starts, side="right")
    hits = np.nonzero(
        (first < len(starts))
        & (starts[np.minimum(first, len(starts) - 1)] < nulls.ends)
    )[0]
    if not len(hits):
        return None
    k = int(hits[0])
    return (
        f"null {nulls.label(k)} overlaps owned {owned.label(order[first[k]])}; "
        "padded CUDA-graph slots write through null blocks"
    )


def check_pooled_views(
    config: PooledKVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    state_floors: Iterable[int] | None = None,
) -> list[FloorCheck]:
    """Check the worker's views of a pooled config; raise on the first fault.

    ``kv_caches`` is what ``allocate_kv_cache`` returned (one view per
    layer over the arena buffer, blocks on dim 0). For every state floor
    (default: :func:`boundary_floors`), the blocks each pool owns there are
    laid out for every layer and must be pairwise disjoint; every view must
    lie inside the arena for all of its ids; unless the null blocks may
    overlap owned blocks (no CUDA graphs), both pools' id 0 must stay clear
    of every owned block.
    """
    layout = config.layout
    views = _pool_views(config, kv_caches)
    _check_inside(views, layout.arena_bytes)
    checks = []
    floors = boundary_floors(layout) if state_floors is None else state_floors
    for floor in floors:
        ids = {
            PoolKind.TOKEN: layout.token_ids_at(floor),
            PoolKind.STATE: layout.state_ids_at(floor),
        }
        owned = _collect(views, ids)
        clash = _first_overlap(owned)
        null_runs = 0
        if clash is None and not layout.null_blocks_overlap:
            nulls = _collect(views, {kind: [0] for kind in views})
            null_runs = len(nulls.starts)
            clash = _null_clash(owned, nulls)
        if clash is not None:
            raise PooledViewError(f"state floor {floor}: {clash}")
        checks.append(
            FloorCheck(
                state_floor=floor,
                token_ids=ids[PoolKind.TOKEN],
                state_ids=ids[PoolKind.STATE],
                owned_runs=len(owned.starts),
                null_runs=null_runs,
            )
        )
    return checks
