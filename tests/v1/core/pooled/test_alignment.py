"""Pooled arenas are aligned for any budget: every pool base starts on
``VIEW_ALIGNMENT_BYTES`` and every per-layer view on its page's alignment in
upstream's own layouts (``page_alignment``: the page size's largest power of
two, 16 to 256 B), so upstream's worker code can view state pages as
bf16/float32 and kernels get the bases they get upstream, without padding a
real model's pages.

Upstream's own ``allocate_kv_cache`` builds the views (on the meta device:
no memory), and upstream's ``MambaBase.bind_kv_cache`` unpacks the state
pages exactly as a GDN/Mamba layer does at start-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from vllm_hybrid.v1.core.pooled.layers import page_alignment, split_layers
from vllm_hybrid.v1.core.pooled.planner import (
    PooledBudget,
    PooledPlanError,
    plan_pooled_kv_cache,
)
from vllm_hybrid.v1.core.pooled.spec import VIEW_ALIGNMENT_BYTES

MiB = 2**20


def specs(block_size: int, conv: tuple[int, int], ssm: tuple[int, int, int]):
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    state = MambaSpec(
        block_size=block_size,
        shapes=(conv, ssm),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    layers = {f"model.layers.{i}": state for i in range(3)}
    layers["model.layers.3"] = attention
    return layers


def bind(view: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, view)
    return layer.kv_cache


def check_views(config) -> list[tuple[int, int]]:
    """(start offset, page bytes) of every layer view, after binding them as
    the layers do."""
    views = allocate_kv_cache(config, torch.device("meta"), KVCacheLayout.LBHNC)
    starts = []
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            view = views[name]
            if isinstance(group.kv_cache_spec, MambaSpec):
                for state in bind(view, group.kv_cache_spec):
                    assert state.storage_offset() * state.element_size() % 4 == 0
            start = view.storage_offset() * view.element_size()
            assert start + view.shape[0] * view.stride(0) * view.element_size() <= (
                config.arena_bytes + view.stride(0) * view.element_size()
            )
            starts.append((start, group.kv_cache_spec.page_size_bytes))
    return starts


@given(
    budget=st.integers(min_value=2 * MiB, max_value=40 * MiB),
    overlap=st.booleans(),
    block_size=st.sampled_from([16, 32, 128]),
    # 38: a page off the alignment (upstream packs the fp32 state after the
    # bf16 conv state, so the conv bytes must stay a multiple of 4 anyway)
    conv_dim=st.sampled_from([1024, 1000, 38]),
)
def test_any_budget_gives_aligned_views(budget, overlap, block_size, conv_dim):
    layers = specs(block_size, (3, conv_dim), (2, 64, 64))
    try:
        config = plan_pooled_kv_cache(
            split_layers(layers),
            PooledBudget(
                arena_bytes=budget,
                max_model_len=block_size,
                max_num_seqs=4,
                null_blocks_overlap=overlap,
            ),
        )
    except PooledPlanError:
        return
    assert config.arena_bytes % VIEW_ALIGNMENT_BYTES == 0
    assert budget - VIEW_ALIGNMENT_BYTES < config.arena_bytes <= budget
    assert config.layout.state_offset % VIEW_ALIGNMENT_BYTES == 0
    for tensor in config.kv_cache_tensors:
        assert tensor.block_stride % VIEW_ALIGNMENT_BYTES == 0
    for start, page in check_views(config):
        assert start % page_alignment(page) == 0
        assert start % 16 == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_odd_budget_that_crashed_start_up_binds(overlap):
    # tiny qwen3_next's state page (conv 3 x 2048 bf16, 4 x 128 x 128 fp32) in
    # 32 MiB + 1 B: before alignment the state pool started at an odd byte
    # with overlapping null blocks, and the bf16 view of the conv state failed.
    layers = specs(128, (3, 2048), (4, 128, 128))
    config = plan_pooled_kv_cache(
        split_layers(layers),
        PooledBudget(
            arena_bytes=32 * MiB + 1,
            max_model_len=512,
            max_num_seqs=4,
            null_blocks_overlap=overlap,
        ),
    )
    assert config.arena_bytes == 32 * MiB
    state = config.kv_cache_tensors[1]
    assert state.offset % VIEW_ALIGNMENT_BYTES == 0
    assert len(check_views(config)) == 4


def test_pages_off_the_alignment_are_padded_and_reported():
    # conv 3 x 38 bf16 = 228 B + ssm 2 x 64 x 64 fp32 = 32,768 B: a page of
    # 32,996 B (4-byte aligned) is laid out every 33,008 B (16-byte aligned,
    # 12 B of padding per layer), and the block of three is rounded up to
    # 99,072 B (256-byte aligned): 84 B per block in all
    layers = specs(16, (3, 38), (2, 64, 64))
    split = split_layers(layers)
    assert split.state.spec.page_size_bytes == 32_996
    assert split.state.runs[0].layer_stride == 33_008
    assert split.state.block_bytes == 99_072
    assert split.state.padding_bytes == 84
    config = plan_pooled_kv_cache(
        split, PooledBudget(arena_bytes=8 * MiB, max_model_len=64, max_num_seqs=4)
    )
    from vllm_hybrid.v1.core.pooled.planner import describe_plan

    assert "(84 B padding)" in describe_plan(config)


@pytest.mark.parametrize(
    ("page", "alignment"),
    [(12_416, 128), (24_832, 256), (2_146_304, 256), (32_996, 16), (6_208, 64)],
)
def test_pages_start_where_upstream_starts_them(page, alignment):
    """TurboQuant k8v4 at head size 256 and 16 tokens x 2 heads: 12,416 B,
    which upstream places at multiples of itself (128-byte aligned); pooled
    blocks hold such pages side by side with no padding per page."""
    assert page_alignment(page) == alignment


def test_turboquant_block_of_ten_layers_is_not_padded():
    """The flagship's token block: 10 TurboQuant pages of 12,416 B are
    124,160 B, a multiple of 256 B: 7,760 B per token, upstream's figure."""
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    page = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=256,
        head_size_v=256,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode("turboquant_k8v4"),
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import customize_attention_spec

    page = customize_attention_spec(AttentionBackendEnum.TURBOQUANT.get_class(), page)
    assert page.page_size_bytes == 12_416
    layers = {f"model.layers.{i}.attn": page for i in range(10)}
    layers["model.layers.10.mixer"] = specs(16, (3, 1024), (2, 64, 64))[
        "model.layers.0"
    ]
    split = split_layers(layers)
    assert [run.layer_stride for run in split.token.runs] == [12_416]
    assert split.token.block_bytes == 124_160
    assert split.token.padding_bytes == 0
