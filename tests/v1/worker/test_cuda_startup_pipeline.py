"""Pipeline stages of the Qwen3.6-35B-A3B-FP8 shape in pooled mode (CUDA plan).

Four stages of 10 layers hold 2 attention + 8 GDN, then 3 + 7, 2 + 8, 3 + 7
layers, so their own blocks differ in bytes both ways. Every stage gets blocks
padded to the largest (3 attention pages, 8 GDN states); each stage's views,
allocated as its worker would (``meta``), must stay inside the stage's arena
and disjoint at every boundary position, with the null blocks clear of owned
blocks as CUDA graphs need. The cost against each stage's own plan is
computed from the same planner.
"""

from __future__ import annotations

import pytest
from cuda_startup import (
    MiB,
    allocate,
    backend_class,
    captured,
    current_platform_as,
    resolve_layout,
    start_worker,
)

from vllm_hybrid.v1.core.pooled.capacity import pooled_capacity
from vllm_hybrid.v1.core.pooled.layers import split_layers
from vllm_hybrid.v1.worker.pooled_views import check_pooled_views

BUDGET = 2048 * MiB
STAGES = 4


def _stage_specs(specs: dict) -> list[dict]:
    from vllm.distributed.utils import get_pp_indices

    def index(name: str) -> int:
        return int(name.split(".")[2])

    stages = []
    for rank in range(STAGES):
        start, end = get_pp_indices(40, rank, STAGES)
        stages.append({n: s for n, s in specs.items() if start <= index(n) < end})
    return stages


@pytest.fixture(scope="module")
def staged(cuda_configs):
    import vllm.v1.core.kv_cache_utils as kvu

    request, config = cuda_configs(BUDGET, 16, "auto")
    backend = backend_class("FLASH_ATTN")
    startup = start_worker(request, backend, base=config)
    layout = resolve_layout(startup)
    stages = _stage_specs(startup.specs)
    config = startup.vllm_config
    config.parallel_config.pipeline_parallel_size = STAGES
    engine = "vllm.hybrid.v1.core.pooled.engine"
    with current_platform_as(startup.platform()), captured(engine) as lines:
        configs = kvu.get_kv_cache_configs(config, stages, [BUDGET] * STAGES)
    return startup, backend, layout, stages, configs, lines


def test_stage_layers_differ_both_ways(staged):
    stages = staged[3]
    splits = [split_layers(specs) for specs in stages]
    counts = [(len(s.token.layer_names), len(s.state.layer_names)) for s in splits]
    assert counts == [(2, 8), (3, 7), (2, 8), (3, 7)]


def test_every_stage_gets_the_largest_blocks_and_says_so(staged):
    startup, _, _, stages, configs, lines = staged
    splits = [split_layers(specs) for specs in stages]
    token = max(s.token.block_bytes for s in splits)
    state = max(s.state.block_bytes for s in splits)
    assert token == 3 * splits[0].token.runs[0].layer_stride
    assert state == 8 * splits[0].state.runs[0].layer_stride
    assert {
        (c.layout.token_block_bytes, c.layout.state_block_bytes) for c in configs
    } == {(token, state)}
    assert len({c.layout for c in configs}) == 1
    (padding,) = [line for line in lines if "padded to the largest" in line]
    assert f"stage 1: token {token:,} of {token:,} B" in padding
    assert f"stage 0: token {2 * token // 3:,} of {token:,} B" in padding
    # CUDA graphs: the null region stays clear of owned blocks
    assert not configs[0].layout.null_blocks_overlap
    for config, specs in zip(configs, stages, strict=True):
        assert {n for g in config.kv_cache_groups for n in g.layer_names} == set(specs)


def test_every_stage_view_stays_inside_its_arena_at_every_boundary(staged):
    _, backend, layout, _, configs, _ = staged
    for config in configs:
        worker = allocate(config, backend, layout)
        checks = check_pooled_views(config, worker.kv_caches)
        assert len(checks) >= 3
        assert all(check.owned_runs > 0 for check in checks)


def test_cost_against_each_stage_alone(staged):
    """What padding costs, against each stage planned alone at the same
    budget (no shared rule can beat the tightest of those)."""
    from vllm_hybrid.v1.core.pooled.engine import plan_pooled_configs

    startup, _, _, stages, configs, _ = staged
    config = startup.vllm_config
    max_len = config.model_config.max_model_len
    shared = pooled_capacity(configs[0], max_len)
    config.parallel_config.pipeline_parallel_size = 1
    with current_platform_as(startup.platform()):
        alone = [
            pooled_capacity(plan_pooled_configs(config, [s], [BUDGET])[0], max_len)
            for s in stages
        ]
    config.parallel_config.pipeline_parallel_size = STAGES
    tokens = min(c.token_capacity for c in alone)
    concurrency = min(c.max_concurrency for c in alone)
    print(
        f"PP={STAGES}: shared {shared.token_capacity:,} tokens, "
        f"{shared.max_concurrency:.2f}x; stages alone "
        f"{[(c.token_capacity, round(c.max_concurrency, 2)) for c in alone]}"
    )
    # one long request: the token block is stage 1's own (3 attention
    # layers), so the tokens match the tightest stage (state-block rounding
    # of the boundary aside)
    assert abs(shared.token_capacity - tokens) / tokens < 0.01
    # requests of max_model_len at once: each also carries a state block of
    # 8 GDN layers on every stage and a token block of 3 attention layers
    assert 0.90 < shared.max_concurrency / concurrency < 0.92
