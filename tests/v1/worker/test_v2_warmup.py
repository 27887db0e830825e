"""Model Runner V2's start-up warm-up on the flagship's pooled KV cache.

Upstream's ``_warmup_kernels`` builds the steps' ``SchedulerOutput`` itself;
here it runs on a stand-in runner that answers what the function reads (the
real CUDA ``VllmConfig`` and the pooled plan of Qwen3.6-35B-A3B-FP8 at
256 MiB, 16-token blocks) and a worker that records each step instead of
running a model. The block tables V2 builds per group are the ids of a
request's ``NewRequestData`` followed by those of its cached steps.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from cuda_startup import (
    MiB,
    backend_class,
    plan_engine_core,
    plan_upstream,
    start_worker,
)
from vllm.config.compilation import CUDAGraphMode

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.tools.plan.config import current_platform_as
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind
from vllm_hybrid.v1.worker.v2_warmup import (
    PooledWarmupError,
    PooledWarmupIds,
    warmup_kernels_pooled,
    warmup_request_limit,
)

BUDGET = 256 * MiB
REPLACEMENT = "vllm_hybrid.v1.worker.v2_warmup"


def _upstream_warmup():
    return upstream_of(REPLACEMENT, "warmup_kernels_pooled")


@pytest.fixture(scope="module")
def flagship(cuda_configs):
    """(VllmConfig, pooled plan) of the flagship at 256 MiB, CUDA graphs on."""
    request, config = cuda_configs(BUDGET, 16)
    startup = start_worker(request, backend_class("FLASH_ATTN"), base=config)
    plan = plan_engine_core(startup).worker_configs[0]
    assert isinstance(plan, PooledKVCacheConfig)
    return startup, plan


def stand_in_runner(vllm_config, kv_cache_config, spec_steps: int = 0):
    """What upstream's warm-up reads of a V2 ``GPUModelRunner``."""
    return SimpleNamespace(
        vllm_config=vllm_config,
        model_config=vllm_config.model_config,
        scheduler_config=vllm_config.scheduler_config,
        max_model_len=vllm_config.model_config.max_model_len,
        kv_cache_config=kv_cache_config,
        num_speculative_steps=spec_steps,
        decode_query_len=1 + spec_steps,
        is_pooling_model=False,
        is_encoder_decoder=False,
        is_last_pp_rank=True,
        model_state=SimpleNamespace(),
        block_tables=None,
        kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None),
    )


def block_tables(warmup, runner) -> tuple[list, list[dict[str, list[int]]]]:
    """Run ``warmup`` with a recording worker; returns the steps and, per KV
    cache group, each request's block table row."""
    steps = []
    warmup(runner, steps.append, lambda grammar: None)
    groups = len(runner.kv_cache_config.kv_cache_groups)
    rows: list[dict[str, list[int]]] = [{} for _ in range(groups)]
    for step in steps:
        for new in step.scheduled_new_reqs:
            for g, ids in enumerate(new.block_ids):
                rows[g][new.req_id] = list(ids)
        cached = step.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            for g, ids in enumerate(new_ids or ()):
                rows[g][req_id] += ids
    return steps, rows


def _all_ids(rows: dict[str, list[int]]) -> list[int]:
    return [i for row in rows.values() for i in row]


def test_upstream_writes_states_outside_the_state_pool(flagship):
    """The failure the replacement exists for: 128 warm-up requests, one id
    counter for both groups, state ids up to 256 in a 4-id state pool."""
    startup, plan = flagship
    token, state = (plan.pool_by_kind(k) for k in (PoolKind.TOKEN, PoolKind.STATE))
    assert (token.group_ids, state.group_ids) == ((0,), (1,))
    assert (token.num_blocks, state.num_blocks) == (819, 4)
    runner = stand_in_runner(startup.vllm_config, plan)
    _, rows = block_tables(_upstream_warmup(), runner)
    assert len(rows[1]) == 128
    # request i: token block 2i + 1, state block 2i + 2
    assert sorted(_all_ids(rows[0])) == list(range(1, 256, 2))
    assert sorted(_all_ids(rows[1])) == list(range(2, 257, 2))
    assert sum(i >= state.num_blocks for i in _all_ids(rows[1])) == 127


def test_pooled_warmup_keeps_every_id_in_its_pool(flagship):
    startup, plan = flagship
    layout = plan.layout
    floor = layout.initial_state_floor
    token_ids, state_ids = layout.token_ids_at(floor), layout.state_ids_at(floor)
    # the null region (a state block) holds token ids below 197
    assert (token_ids, state_ids) == (range(197, 393), range(2, 4))
    runner = stand_in_runner(startup.vllm_config, plan)
    steps, rows = block_tables(warmup_kernels_pooled, runner)
    # one token and one state block per request: the two owned state blocks
    # bound the warm-up at two requests
    assert warmup_request_limit(plan, [1, 1]) == 2
    assert sorted(rows[0]) == sorted(rows[1]) == ["_warmup_0_", "_warmup_1_"]
    assert sorted(_all_ids(rows[0])) == [197, 198]
    assert sorted(_all_ids(rows[1])) == [2, 3]
    # upstream's steps otherwise: the prefill, three decode shapes, cleanup
    assert len(steps) == 5
    assert steps[0].total_num_scheduled_tokens == 2 * 2
    assert steps[-1].finished_req_ids == {"_warmup_0_", "_warmup_1_"}


def test_speculative_warmup_fits_one_request(flagship):
    """Two drafts: upstream sizes a request for 19 tokens (a 4-token prompt,
    five 3-token decode steps), two blocks of each group; the state pool
    holds one such request. Its steps then reach 8 tokens, one block."""
    startup, plan = flagship
    runner = stand_in_runner(startup.vllm_config, plan, spec_steps=2)
    steps, rows = block_tables(warmup_kernels_pooled, runner)
    assert rows == [{"_warmup_0_": [197]}, {"_warmup_0_": [2]}]
    assert [s.total_num_scheduled_tokens for s in steps] == [4, 3, 1, 0]


def test_other_configs_get_upstreams_warmup(flagship):
    """The single pool's plan goes to upstream's function unchanged."""
    startup, _ = flagship
    _, plan = plan_upstream(startup)
    assert not isinstance(plan, PooledKVCacheConfig)
    runner = stand_in_runner(startup.vllm_config, plan)
    ours, ours_rows = block_tables(warmup_kernels_pooled, runner)
    theirs, their_rows = block_tables(_upstream_warmup(), runner)
    assert ours_rows == their_rows
    assert [s.num_scheduled_tokens for s in ours] == [
        s.num_scheduled_tokens for s in theirs
    ]


def test_ids_beyond_a_pool_are_refused(flagship):
    _, plan = flagship
    ids = PooledWarmupIds(plan)
    assert ids.pool_ids(1, [7, 9, 7]) == [2, 3, 2]
    assert ids.pool_ids(0, [8]) == [197]
    with pytest.raises(PooledWarmupError, match="state pool owns"):
        ids.pool_ids(1, [11])
    assert ids.used() == {PoolKind.TOKEN: range(197, 198), PoolKind.STATE: range(2, 4)}


def test_no_warmup_when_one_request_does_not_fit(flagship):
    _, plan = flagship
    assert warmup_request_limit(plan, [1, 3]) == 0
    assert warmup_request_limit(plan, [196, 1]) == 1
    assert warmup_request_limit(plan, [197, 1]) == 0


def _runner_choice(config, monkeypatch, forced: str | None) -> bool:
    """``VllmConfig.use_v2_model_runner`` as a CUDA host answers it: Triton
    present (this host's vLLM reports none), ``VLLM_USE_V2_MODEL_RUNNER``
    as given."""
    import vllm.config.vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    if forced is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", forced)
    return config.use_v2_model_runner


def test_the_flagship_starts_pooled_on_model_runner_v2(flagship, monkeypatch):
    """vLLM's CUDA default holds for pooled mode: nothing in V2's list of
    unsupported features, pooled mode on, and with the V1 runner forced
    (upstream's switch) pooled mode stays on as well."""
    from vllm_hybrid.v1.core.pooled.engine import null_blocks_may_overlap
    from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision

    startup, plan = flagship
    config = startup.vllm_config
    assert config._get_v2_model_runner_unsupported_features() == []
    assert _runner_choice(config, monkeypatch, None) is True
    assert pooled_mode_decision(config).enabled
    assert not plan.layout.null_blocks_overlap
    assert _runner_choice(config, monkeypatch, "0") is False
    assert pooled_mode_decision(config).enabled
    # V2 writes through state id 0 in eager mode too (dummy runs): the null
    # region stays clear of owned blocks unless the V1 runner is forced
    eager = copy.deepcopy(config)
    eager.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    with current_platform_as(startup.platform()):
        assert null_blocks_may_overlap(eager) is True
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
        assert null_blocks_may_overlap(eager) is False


def test_adaptive_verification_keeps_the_single_pool(flagship):
    from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision

    startup, _ = flagship
    config = copy.copy(startup.vllm_config)
    config.speculative_config = SimpleNamespace(
        method="mtp", enable_adaptive_verification=True
    )
    decision = pooled_mode_decision(config)
    assert not decision.enabled
    assert decision.reason == "unsupported: adaptive speculative verification"
