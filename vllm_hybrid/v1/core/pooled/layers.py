"""Which layers go to which pool, and how one block id lays out their pages.

A pooled arena has a *token* pool for the attention layers and a *state*
pool for the recurrent-state layers (:mod:`.spec`). One block id of a pool
covers one page of every layer of that pool, side by side; this module sorts
a worker's layer specs into the two pools and computes each block's bytes
and where each layer's page sits in it. Pure: specs in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vllm.utils.math_utils import round_up
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

from vllm_hybrid.v1.core.pooled.spec import VIEW_ALIGNMENT_BYTES, align_up

#: Fewest bytes a page start is aligned to: Triton compiles pointer arguments
#: for 16-byte divisibility (and vectorizes loads by it), ``.view(dtype)``
#: needs the element size, and no KV or state dtype is wider than 16 B.
MIN_PAGE_ALIGNMENT_BYTES = 16


def page_alignment(page_bytes: int) -> int:
    """The byte boundary a layer's page starts on in a pooled block.

    Upstream's layouts put block ``b`` of a layer at ``base + b * page``, so
    the kernels run there with pages aligned to the largest power of two
    dividing the page size (TurboQuant k8v4 at 16 tokens x 2 heads: 12,416 B,
    128-byte aligned), never better than the 256 B of an allocation.
    Aligning every page the same way costs no byte per page: only the whole
    block is rounded up to ``VIEW_ALIGNMENT_BYTES`` (once), where pool bases
    and block strides need it.
    """
    natural = page_bytes & -page_bytes
    return max(MIN_PAGE_ALIGNMENT_BYTES, min(VIEW_ALIGNMENT_BYTES, natural))


@dataclass(frozen=True)
class PoolLayers:
    """Layers of one pool and how one block id lays out their pages.

    ``spec`` is one spec shared by every layer, or for a token pool whose
    attention layers differ only in page bytes (e.g. TurboQuant layers next
    to native-dtype skip layers) upstream's ``UniformTypeKVCacheSpecs``
    holding each layer's spec: the layers share a block size and a block id,
    and each keeps its own page.
    """

    spec: KVCacheSpec
    layer_names: tuple[str, ...]
    #: Lower bound of :attr:`block_bytes`: pipeline stages whose blocks have
    #: other bytes are padded to the largest (:func:`equalize_stage_blocks`).
    min_block_bytes: int = 0

    def layer_spec(self, name: str) -> KVCacheSpec:
        if isinstance(self.spec, UniformTypeKVCacheSpecs):
            return self.spec.kv_cache_specs[name]
        return self.spec

    @property
    def runs(self) -> tuple[LayerRun, ...]:
        """The block's layers, one run per page size (first seen first),
        each run's pages side by side at its own stride."""
        by_page: dict[int, list[str]] = {}
        for name in self.layer_names:
            by_page.setdefault(self.layer_spec(name).page_size_bytes, []).append(name)
        runs, offset = [], 0
        for page, names in by_page.items():
            alignment = page_alignment(page)
            run = LayerRun(
                tuple(names),
                page,
                align_up(page, alignment),
                align_up(offset, alignment),
            )
            runs.append(run)
            offset = run.offset + run.bytes
        return tuple(runs)

    @property
    def padding_bytes(self) -> int:
        """Bytes per block that hold no page (the block's alignment only)."""
        pages = sum(self.layer_spec(n).page_size_bytes for n in self.layer_names)
        return self.block_bytes - pages

    @property
    def block_bytes(self) -> int:
        raw = max(sum(run.bytes for run in self.runs), self.min_block_bytes)
        alignment = VIEW_ALIGNMENT_BYTES
        for name in self.layer_names:
            spec_alignment = self.layer_spec(name).get_block_stride_alignment()
            alignment = math.lcm(alignment, max(1, spec_alignment))
        return round_up(raw, alignment)


@dataclass(frozen=True)
class LayerRun:
    """Layers of one page size within a block: layer ``k``'s page starts at
    ``offset + k * layer_stride`` bytes into the block."""

    layer_names: tuple[str, ...]
    page_bytes: int
    #: The page rounded up to its :func:`page_alignment` (the page itself for
    #: every real model: their pages are multiples of 16 B).
    layer_stride: int
    offset: int

    @property
    def bytes(self) -> int:
        return len(self.layer_names) * self.layer_stride


@dataclass(frozen=True)
class PoolSplit:
    """The attention and state layers of a model, or why there is no split."""

    token: PoolLayers | None
    state: PoolLayers | None
    reason: str = ""


def split_layers(kv_cache_spec: dict[str, KVCacheSpec]) -> PoolSplit:
    """Sort layers into one token pool and one state pool.

    State layers must share one spec. Attention layers may differ in page
    bytes (per-layer KV dtypes: ``--kv-cache-dtype-skip-layers``; head sizes)
    as long as they are of one type with one block size, which upstream
    expresses as ``UniformTypeKVCacheSpecs``; attention of different types
    (sliding window or chunked local next to full attention) needs more than
    one token block table and returns a reason: the engine keeps upstream's
    plan.
    """
    attention: dict[str, KVCacheSpec] = {}
    state: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, MambaSpec):
            state[name] = spec
        elif isinstance(spec, AttentionSpec):
            attention[name] = spec
        else:
            return PoolSplit(None, None, f"layer {name} has a {type(spec).__name__}")
    if not attention or not state:
        return PoolSplit(None, None, "model is not attention + state hybrid")
    if len(set(state.values())) != 1:
        return PoolSplit(None, None, "state layers have different specs")
    attn_spec: KVCacheSpec | None = next(iter(attention.values()))
    if len(set(attention.values())) != 1:
        attn_spec = UniformTypeKVCacheSpecs.from_specs(attention)
        if attn_spec is None:
            return PoolSplit(
                None,
                None,
                "attention layers of different types or block sizes (e.g. "
                "sliding window next to full attention) need one token block "
                "table each",
            )
    state_spec = next(iter(state.values()))
    if getattr(state_spec, "page_size_padded", None) is not None:
        return PoolSplit(None, None, "state pages are padded (platform alignment ran)")
    if any(getattr(s, "page_size_padded", None) for s in attention.values()):
        return PoolSplit(
            None, None, "attention pages are padded (platform alignment ran)"
        )
    return PoolSplit(
        PoolLayers(attn_spec, tuple(attention)),
        PoolLayers(state_spec, tuple(state)),
    )


def equalize_stage_blocks(splits: list[PoolSplit]) -> list[PoolSplit]:
    """Pad every pipeline stage's token and state block to the largest of
    any stage.

    One scheduler hands out one token-block and one state-block id space and
    moves one boundary for all stages, while each stage maps an id to its own
    layers' bytes. With blocks of one size on every stage, an id and a
    boundary position mean the same bytes everywhere, so every stage stays
    inside its buffer wherever the boundary is. The price is the padding of
    the lighter stages: the arena holds the blocks the heaviest stage's
    layers would (docs/pooled-mode.md, "Pipeline parallel").
    """
    token = max(split.token.block_bytes for split in splits if split.token)
    state = max(split.state.block_bytes for split in splits if split.state)
    return [
        PoolSplit(
            replace(split.token, min_block_bytes=token),
            replace(split.state, min_block_bytes=state),
        )
        if split.token is not None and split.state is not None
        else split
        for split in splits
    ]
