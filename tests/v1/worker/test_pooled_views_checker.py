"""The view checker finds what it looks for, and real memory agrees with it.

Deliberately broken pooled configs (a state pool shifted into the token
pool, layer pages that overlap, a view longer than the arena, null blocks
over owned blocks under CUDA graphs) must each be reported. On one real CPU
allocation of the CUDA plan, writing a tag through every layer's view of the
blocks it owns shows the same disjointness in memory, and upstream's
``KVBlockZeroer`` (which V1 builds at start-up from ``num_blocks``) zeroes
exactly the token blocks it is asked for.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from cuda_startup import (
    MiB,
    allocate,
    backend_class,
    plan_engine_core,
    start_worker,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PoolKind
from vllm_hybrid.v1.worker.pooled_views import PooledViewError, check_pooled_views

BUDGET = 256 * MiB


@pytest.fixture(scope="module")
def plans(cuda_configs):
    """``plans(eager) -> (backend, pooled config)`` for FlashAttention, 16.
    ``eager``: no CUDA graphs on the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``),
    the CUDA plan whose null blocks overlap owned blocks."""
    done = {}

    def get(eager: bool):
        if eager not in done:
            request, config = cuda_configs(BUDGET, 16, "auto")
            backend = backend_class("FLASH_ATTN")
            startup = start_worker(request, backend, eager=eager, base=config)
            with pytest.MonkeyPatch.context() as env:
                if eager:
                    env.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
                plan = plan_engine_core(startup).worker_configs[0]
            done[eager] = (backend, plan)
        return done[eager]

    return get


def _check(backend, config):
    worker = allocate(config, backend, KVCacheLayout.LBNHC)
    return check_pooled_views(config, worker.kv_caches)


def _with_tensor(config, index: int, **changes):
    broken = dataclasses.replace(config, kv_cache_tensors=list(config.kv_cache_tensors))
    broken.kv_cache_tensors[index] = dataclasses.replace(
        config.kv_cache_tensors[index], **changes
    )
    return broken


def test_the_plans_pass(plans):
    for eager in (False, True):
        assert _check(*plans(eager))


def test_state_pool_shifted_into_the_token_pool_is_reported(plans):
    backend, config = plans(True)
    state = config.kv_cache_tensors[1]
    assert state.offset == config.layout.state_offset > 0
    shifted = _with_tensor(
        config, 1, offset=state.offset - config.layout.token_block_bytes
    )
    with pytest.raises(PooledViewError, match="token block .* overlaps state block"):
        _check(backend, shifted)


def test_overlapping_layer_pages_are_reported(plans):
    backend, config = plans(False)
    token = config.kv_cache_tensors[0]
    squeezed = _with_tensor(config, 0, layer_stride=token.layer_stride - 256)
    with pytest.raises(
        PooledViewError,
        match=r"token block \d+ of model\.layers\.\d+\.self_attn\.attn .* overlaps "
        r"token block \d+ of model\.layers\.\d+\.self_attn\.attn",
    ):
        _check(backend, squeezed)


def test_view_past_the_arena_is_reported(plans):
    backend, config = plans(False)
    pools = [
        dataclasses.replace(p, num_blocks=p.num_blocks + 1)
        if p.kind is PoolKind.STATE
        else p
        for p in config.pools
    ]
    longer = dataclasses.replace(config, pools=pools)
    with pytest.raises(PooledViewError, match="state pool view .* outside the arena"):
        _check(backend, longer)


def test_null_block_over_owned_blocks_under_cuda_graphs_is_reported(plans):
    """The eager plan's views (state view at the arena's top, null blocks
    overlapping owned ones) claimed as a CUDA-graph plan: state id 0, which
    padded decode slots write to, lies over token blocks the pool owns."""
    backend, config = plans(True)
    layout = config.layout
    graphs = ArenaLayout(
        arena_bytes=layout.arena_bytes,
        token_block_bytes=layout.token_block_bytes,
        state_block_bytes=layout.state_block_bytes,
        min_token_blocks=layout.min_token_blocks,
        min_state_blocks=layout.min_state_blocks,
        initial_boundary=layout.initial_boundary,
        null_blocks_overlap=False,
    )
    claimed = dataclasses.replace(config, arena=graphs)
    with pytest.raises(PooledViewError, match="null state block 0 .* overlaps owned"):
        _check(backend, claimed)


# ---------------------------------------------------------------------------
# Real memory
# ---------------------------------------------------------------------------


def _arena(kv_caches) -> torch.Tensor:
    storage = next(iter(kv_caches.values())).untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage)


def _raw(view: torch.Tensor) -> torch.Tensor:
    return view if view.dtype == torch.int8 else view.view(torch.int8)


def test_tags_written_through_views_stay_where_the_checker_says(plans):
    from vllm.v1.worker.utils import KVBlockZeroer

    backend, config = plans(False)
    worker = allocate(config, backend, KVCacheLayout.LBNHC, device="cpu")
    layout = config.layout
    floor = layout.initial_state_floor
    (check,) = check_pooled_views(config, worker.kv_caches, [floor])
    owned = {PoolKind.TOKEN: check.token_ids, PoolKind.STATE: check.state_ids}
    layers = [
        (kind, name)
        for kind, group in zip(
            (PoolKind.TOKEN, PoolKind.STATE), config.kv_cache_groups, strict=True
        )
        for name in group.layer_names
    ]
    expected_bytes = 0
    for tag, (kind, name) in enumerate(layers, start=1):
        ids = torch.tensor(list(owned[kind]))
        _raw(worker.kv_caches[name])[ids] = tag
        page = config.kv_cache_groups[kind is PoolKind.STATE].kv_cache_spec
        expected_bytes += len(ids) * page.page_size_bytes
    # no layer's owned bytes were overwritten by another layer's
    for tag, (kind, name) in enumerate(layers, start=1):
        ids = torch.tensor(list(owned[kind]))
        assert bool((_raw(worker.kv_caches[name])[ids] == tag).all()), name
    arena = _arena(worker.kv_caches)
    assert arena.numel() == layout.arena_bytes
    assert int(torch.count_nonzero(arena)) == expected_bytes

    # V1's start-up builds the zeroer for attention layers with num_blocks
    zeroer = KVBlockZeroer(
        torch.device("cpu"),
        attn_groups_iter=(g for groups in worker.attn_groups for g in groups),
        kernel_block_sizes=worker.kernel_block_sizes,
        static_forward_context={
            name: SimpleNamespace(kv_cache=view)
            for name, view in worker.kv_caches.items()
        },
        num_blocks=config.num_blocks,
    )
    addrs, strides, pages, _, _, segments = zeroer._meta
    assert segments == 10
    assert set((strides * 4).tolist()) == {layout.token_block_bytes}
    page_bytes = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert set((pages * 4).tolist()) == {page_bytes}
    base = arena.data_ptr()
    for block in check.token_ids:
        segs = zip(addrs.tolist(), strides.tolist(), pages.tolist(), strict=True)
        for addr, stride, page in segs:
            start = addr - base + block * stride * 4
            arena[start : start + page * 4] = 0
    # zeroing every owned token block left no token tag and every state tag
    for tag, (kind, name) in enumerate(layers, start=1):
        ids = torch.tensor(list(owned[kind]))
        want = 0 if kind is PoolKind.TOKEN else tag
        assert bool((_raw(worker.kv_caches[name])[ids] == want).all()), name
