"""Attention layers of a pooled arena, driven through upstream's CUDA backends.

The attention conformance tests run each kernel through the backend object a
CUDA worker builds for an attention layer (``TritonAttentionImpl`` for a bf16
KV cache, ``TurboQuantAttentionImpl`` for ``--kv-cache-dtype
turboquant_k8v4``), calling the same two entry points the model calls:
``do_kv_cache_update`` (the store kernel) and ``forward`` (the attention
kernel). The impls reinterpret the ``[B, H, N, C]`` manager view themselves,
so the tests exercise the exact view arithmetic a CUDA run does.

Each batch runs twice with the same inputs: on the pooled views and on
:func:`layout_twin` copies (one dense tensor per layer, upstream's single
pool). :func:`compare` then reports whether the outputs, the owned pages and
the bytes outside the pages the batch addresses agree; the tests assert an
empty report, the fault-injection tests a non-empty one.
"""

from __future__ import annotations

import itertools
import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

import torch
from arena_views import (
    DEVICE,
    ArenaViews,
    MiB,
    attention_spec,
    build_arena,
    gdn_spec,
)
from vllm.v1.attention.backends import triton_attn, turboquant_attn
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import AttentionSpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker import workspace
from vllm.v1.worker.utils import customize_attention_spec

from vllm_hybrid.v1.core.pooled.spec import PoolKind

HEAD_SIZE = 256
NUM_KV_HEADS = 2
#: Null block id upstream puts in the block-table rows of padded requests.
NULL_BLOCK_ID = 0
#: TurboQuant's split-KV count (``tq_max_kv_splits_for_cuda_graph``, default
#: 32). Two splits still exercise the cross-split reduction; each split is a
#: separate program the interpreter runs in Python, so fewer keep it fast.
TQ_KV_SPLITS = 2


# ---------------------------------------------------------------------------
# KV cache flavours and test cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Flavor:
    """One ``--kv-cache-dtype`` as a CUDA worker serves attention layers."""

    cache_dtype: str
    backend: type
    spec_dtype: torch.dtype
    #: Query heads per request. bf16 uses Qwen3.6's 16 (8 per KV head).
    #: TurboQuant's decode grid has one program per query head, each run in
    #: Python by the interpreter, so it uses 4 (still 2 per KV head): the
    #: query head count does not change which cache bytes are addressed.
    num_q_heads: int

    def spec(self, block_size: int) -> AttentionSpec:
        """The attention layer's spec as the worker publishes it (the
        backend's ``customize_spec`` plus kernel block alignment)."""
        raw = attention_spec(
            block_size,
            self.spec_dtype,
            kv_quant_mode=get_kv_quant_mode(self.cache_dtype),
        )
        return customize_attention_spec(self.backend, raw)

    def layout(self) -> KVCacheLayout:
        """The layout the engine core resolves: the backend's first choice
        among block-compact layouts (GDN layers declare none)."""
        layouts = get_supported_kv_cache_layouts([self.backend])
        return next(layout for layout in layouts if layout.is_block_compact)


BF16 = Flavor("auto", triton_attn.TritonAttentionBackend, torch.bfloat16, 16)
TURBOQUANT = Flavor(
    "turboquant_k8v4", turboquant_attn.TurboQuantAttentionBackend, torch.uint8, 4
)


@dataclass(frozen=True)
class Case:
    """One arena and boundary position the kernels run on."""

    flavor: Flavor
    block_size: int
    #: ``min``, ``initial`` or ``max``: which state floor the ids are owned at.
    floor: str
    arena_bytes: int = 48 * MiB
    #: CUDA graphs: the null region is reserved (no overlap), stores get
    #: padded slots (-1) and decode batches padded requests.
    cuda_graphs: bool = False
    #: None: the resolved layout; else e.g. ``VLLM_KV_CACHE_LAYOUT=HND``.
    layout: KVCacheLayout | None = None
    #: Attention layer the reads run on.
    layer: int = 1
    seed: int = 0
    #: Read steps this case runs (``decode``, ``prefill``).
    reads: tuple[str, ...] = ("decode", "prefill")

    @property
    def id(self) -> str:
        parts = [
            "bf16" if self.flavor is BF16 else "tq_k8v4",
            f"bs{self.block_size}",
            f"floor_{self.floor}",
            f"{self.arena_bytes // MiB}MiB+{self.arena_bytes % MiB}",
            "cudagraphs" if self.cuda_graphs else "eager",
            f"layer{self.layer}",
        ]
        if self.layout is not None:
            parts.append(self.layout.name)
        return "-".join(parts)

    def build(self) -> ArenaViews:
        """The arena, canary-filled, with ids owned at this case's floor."""
        arena = build_arena(
            self.flavor.spec(self.block_size),
            gdn_spec(self.block_size),
            arena_bytes=self.arena_bytes,
            null_blocks_overlap=not self.cuda_graphs,
            layout=self.layout or self.flavor.layout(),
        )
        layout = arena.config.layout
        arena.state_floor = {
            "min": layout.min_state_floor,
            "initial": layout.initial_state_floor,
            "max": layout.max_state_floor,
        }[self.floor]
        arena.fill_canary()
        return arena


# ---------------------------------------------------------------------------
# Requests and batches
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """Running requests: their lengths and the token block ids they own."""

    block_size: int
    seq_lens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]

    @classmethod
    def place(cls, arena: ArenaViews, seq_lens: tuple[int, ...], seed: int):
        """Give each request its blocks from ``pick`` (scattered, including
        the ids next to the null region and the boundary)."""
        block_size = block_size_of(arena)
        counts = [math.ceil(n / block_size) for n in seq_lens]
        ids = iter(arena.pick(PoolKind.TOKEN, sum(counts), seed=seed))
        blocks = tuple(tuple(itertools.islice(ids, c)) for c in counts)
        return cls(block_size, seq_lens, blocks)

    @property
    def used_ids(self) -> list[int]:
        return [i for row in self.block_ids for i in row]

    def slot(self, request: int, position: int) -> int:
        block = self.block_ids[request][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def shifted(self, by: int) -> Requests:
        """The same requests with every block id off by ``by``."""
        rows = tuple(tuple(i + by for i in row) for row in self.block_ids)
        return Requests(self.block_size, self.seq_lens, rows)


@dataclass(frozen=True)
class Batch:
    """One forward step: how many trailing tokens of each request it
    computes, plus CUDA-graph padding."""

    query_lens: tuple[int, ...]
    #: Padded requests (FULL CUDA graph decode): one padded token each, an
    #: empty query, seq_len 0 and a block-table row of null block ids, as
    #: upstream's model runner pads; the kernels see the padded counts.
    pad_requests: int = 0
    #: Padded tokens of a piecewise CUDA graph step: slot -1 (the stores skip
    #: them); attention sees only the real tokens.
    pad_tokens: int = 0
    #: Each request's length after this step; None: its full length.
    lengths: tuple[int, ...] | None = None

    def lengths_of(self, requests: Requests) -> tuple[int, ...]:
        return self.lengths or requests.seq_lens

    def tokens(self, requests: Requests) -> list[tuple[int, int]]:
        """``(request, position)`` of every real query token, in order."""
        pairs = zip(self.lengths_of(requests), self.query_lens, strict=True)
        return [(r, pos) for r, (n, q) in enumerate(pairs) for pos in range(n - q, n)]

    def slot_mapping(self, requests: Requests) -> torch.Tensor:
        slots = [requests.slot(r, pos) for r, pos in self.tokens(requests)]
        pads = [-1] * (self.pad_tokens + self.pad_requests)
        return torch.tensor(slots + pads, dtype=torch.int64, device=DEVICE)

    def block_table(self, requests: Requests) -> torch.Tensor:
        width = max(len(row) for row in requests.block_ids) + 1
        rows = len(requests.block_ids) + self.pad_requests
        table = torch.full((rows, width), NULL_BLOCK_ID, dtype=torch.int32)
        for r, row in enumerate(requests.block_ids):
            table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table.to(DEVICE)

    def seq_lens(self, requests: Requests) -> torch.Tensor:
        lens = list(self.lengths_of(requests)) + [0] * self.pad_requests
        return torch.tensor(lens, dtype=torch.int32, device=DEVICE)

    def query_start_loc(self) -> torch.Tensor:
        """Cumulative query starts; padded requests repeat the last one."""
        starts = [0, *itertools.accumulate(self.query_lens)]
        starts += [starts[-1]] * self.pad_requests
        return torch.tensor(starts, dtype=torch.int32, device=DEVICE)

    @property
    def real_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Rows of the step's q/k/v and slot mapping (padded included)."""
        return self.real_tokens + self.pad_tokens + self.pad_requests

    @property
    def attention_tokens(self) -> int:
        """``num_actual_tokens``: padded only in a FULL CUDA graph."""
        return self.real_tokens + self.pad_requests


def block_size_of(arena: ArenaViews) -> int:
    view = arena.views[arena.token_layers[0]]
    return view.shape[2]


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclass
class Inputs:
    """Per-layer K/V of every position of every request, and step queries."""

    keys: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def random(cls, arena: ArenaViews, requests: Requests, seed: int) -> Inputs:
        gen = torch.Generator().manual_seed(seed)
        inputs = cls()
        for name in arena.token_layers:
            shape = [(n, NUM_KV_HEADS, HEAD_SIZE) for n in requests.seq_lens]
            inputs.keys[name] = [randn(s, gen) for s in shape]
            inputs.values[name] = [randn(s, gen) for s in shape]
        return inputs

    def step_kv(self, layer: str, requests: Requests, batch: Batch):
        """The step's key/value rows (padded rows are junk, as on CUDA)."""
        keys = [self.keys[layer][r][p] for r, p in batch.tokens(requests)]
        values = [self.values[layer][r][p] for r, p in batch.tokens(requests)]
        pads = batch.num_tokens - batch.real_tokens
        junk = torch.full((pads, NUM_KV_HEADS, HEAD_SIZE), 3.0, device=DEVICE)
        return (
            torch.cat([torch.stack(keys), junk.bfloat16()]),
            torch.cat([torch.stack(values), junk.bfloat16()]),
        )


def randn(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).bfloat16().to(DEVICE)


def queries(flavor: Flavor, batch: Batch, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return randn((batch.num_tokens, flavor.num_q_heads, HEAD_SIZE), gen)


# ---------------------------------------------------------------------------
# Views: upstream's dense per-layer twin, and faulty pooled views
# ---------------------------------------------------------------------------


def layout_twin(view: torch.Tensor, layout: KVCacheLayout) -> torch.Tensor:
    """A dense copy of one layer's view, pages in ``layout``'s in-page order
    and one page apart: the tensor upstream's single pool gives a layer."""
    order = layout.layer_view_order
    shape = [view.shape[d] for d in order]
    dense = torch.empty(shape, dtype=view.dtype, device=view.device)
    twin = dense.permute([order.index(d) for d in range(view.dim())])
    return twin.copy_(view)


def page_elements(arena: ArenaViews) -> int:
    """One attention page, in elements of the view's dtype."""
    view = arena.views[arena.token_layers[0]]
    group = arena.config.pool_by_kind(PoolKind.TOKEN).group_ids[0]
    spec = arena.config.kv_cache_groups[group].kv_cache_spec
    return spec.page_size_bytes // view.element_size()


def shifted_by_a_page(arena: ArenaViews, view: torch.Tensor) -> torch.Tensor:
    """Fault: the view starts one page late (the last block is dropped so
    the view stays inside the allocation)."""
    shape = (view.shape[0] - 1, *view.shape[1:])
    offset = view.storage_offset() + page_elements(arena)
    return view.as_strided(shape, view.stride(), offset)


def block_stride_off_by_a_page(arena: ArenaViews, view: torch.Tensor) -> torch.Tensor:
    """Fault: the block stride is one layer page short. With two attention
    layers this is the stride a dense single-layer tensor has, i.e. a kernel
    that ignored the pooled block stride."""
    stride = (view.stride(0) - page_elements(arena), *view.stride()[1:])
    return view.as_strided(view.shape, stride, view.storage_offset())


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


@contextmanager
def worker_workspace():
    """A workspace manager of our own, as ``GPUModelRunner`` sets one up:
    TurboQuant takes its decode and dequant scratch from it (and needs it
    for continuations longer than 128 tokens)."""
    manager = workspace.WorkspaceManager(DEVICE)
    with mock.patch.object(workspace, "_manager", manager), ExitStack() as stack:
        if not torch.accelerator.is_available():
            # growing the workspace first empties the device cache, which a
            # CPU-only torch refuses; there is nothing to release on a CPU
            stack.enter_context(
                mock.patch.object(torch.accelerator, "empty_cache", lambda: None)
            )
        yield


def attention_layer() -> SimpleNamespace:
    """What the impls read from the ``Attention`` module: unit KV scales
    (bf16 ignores them), and room for TurboQuant's cached rotation."""
    one = torch.ones((), dtype=torch.float32, device=DEVICE)
    return SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)


def make_impl(flavor: Flavor):
    """The backend's impl as the ``Attention`` layer constructs it."""
    kwargs = dict(
        num_heads=flavor.num_q_heads,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype=flavor.cache_dtype,
    )
    if flavor is BF16:
        return triton_attn.TritonAttentionImpl(**kwargs)
    # The impl reads two numbers from the global vLLM config at construction;
    # a full VllmConfig needs a model, so hand it just those.
    config = SimpleNamespace(
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=TQ_KV_SPLITS),
        model_config=SimpleNamespace(max_model_len=512),
    )
    with mock.patch.object(turboquant_attn, "get_current_vllm_config", lambda: config):
        return turboquant_attn.TurboQuantAttentionImpl(**kwargs)


def metadata(flavor: Flavor, requests: Requests, batch: Batch):
    """The attention metadata the backend's builder makes for ``batch``
    (built directly: the builders need a full VllmConfig)."""
    common = dict(
        seq_lens=batch.seq_lens(requests),
        slot_mapping=batch.slot_mapping(requests),
        block_table=batch.block_table(requests),
        query_start_loc=batch.query_start_loc(),
        num_actual_tokens=batch.attention_tokens,
        max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.lengths_of(requests)),
    )
    if flavor is BF16:
        return triton_metadata(common)
    num_decodes = sum(1 for q in batch.query_lens if q == 1)
    return turboquant_attn.TurboQuantMetadata(
        **common,
        is_prefill=max(batch.query_lens) > 1,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc_cpu=common["query_start_loc"].cpu(),
        seq_lens_cpu=common["seq_lens"].cpu(),
    )


def triton_metadata(common: dict) -> triton_attn.TritonAttentionMetadata:
    """``TritonAttentionMetadataBuilder.build``'s result: the 3D (split
    softmax) kernel for decode batches below the sequence threshold."""
    threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // NUM_KV_HEADS
    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    heads = BF16.num_q_heads
    return triton_attn.TritonAttentionMetadata(
        **common,
        causal=True,
        seq_threshold_3D=threshold,
        num_par_softmax_segments=segments,
        softmax_segm_output=zeros(threshold, heads, segments, HEAD_SIZE),
        softmax_segm_max=zeros(threshold, heads, segments),
        softmax_segm_expsum=zeros(threshold, heads, segments),
    )


def zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, device=DEVICE)
