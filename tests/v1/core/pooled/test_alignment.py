"""Pooled arenas are aligned for any budget: every pool base and every
per-layer view starts on ``VIEW_ALIGNMENT_BYTES``, so upstream's worker code
can view state pages as bf16/float32 and kernels get aligned bases.

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

from vllm_hybrid.v1.core.pooled.layers import split_layers
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


def check_views(config) -> list[int]:
    """Start offsets of every layer view, after binding them as the layers do."""
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
            starts.append(start)
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
    for start in check_views(config):
        assert start % VIEW_ALIGNMENT_BYTES == 0


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
    # 32,996 B is laid out every 33,024 B (28 B of padding per layer)
    layers = specs(16, (3, 38), (2, 64, 64))
    split = split_layers(layers)
    assert split.state.spec.page_size_bytes == 32_996
    assert split.state.runs[0].layer_stride == 33_024
    assert split.state.padding_bytes == 3 * 28
    config = plan_pooled_kv_cache(
        split, PooledBudget(arena_bytes=8 * MiB, max_model_len=64, max_num_seqs=4)
    )
    from vllm_hybrid.v1.core.pooled.planner import describe_plan

    assert "(84 B padding)" in describe_plan(config)
