"""Which layers go to which pool, and where each layer's page sits in a
block id (one page of every layer of the pool, side by side). Pure: specs
in, numbers out.
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

#: Fewest bytes a page start is aligned to: Triton specializes pointers on
#: 16-byte divisibility, and no KV or state dtype is wider.
MIN_PAGE_ALIGNMENT_BYTES = 16


def page_alignment(page_bytes: int) -> int:
    """The byte boundary a layer's page starts on in a pooled block: the
    largest power of two dividing the page, as in upstream's layouts (block
    ``b`` at ``base + b * page``), so pages cost no padding."""
    natural = page_bytes & -page_bytes
    return max(MIN_PAGE_ALIGNMENT_BYTES, min(VIEW_ALIGNMENT_BYTES, natural))


@dataclass(frozen=True)
class PoolLayers:
    """Layers of one pool and how one block id lays out their pages.
    ``spec`` is shared by every layer, or upstream's
    ``UniformTypeKVCacheSpecs`` where attention pages differ in bytes."""

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
    """Layers of one page size: layer ``k``'s page starts at
    ``offset + k * layer_stride`` bytes into the block."""

    layer_names: tuple[str, ...]
    page_bytes: int
    #: The page rounded up to its :func:`page_alignment`.
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
    """Sort layers into one token pool and one state pool, or say why not:
    state layers share one spec; attention layers share a type and block
    size (their pages may differ)."""
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
    any stage, so that one id space and boundary mean the same bytes on
    every stage (docs/pooled-mode.md, "Pipeline parallel")."""
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
