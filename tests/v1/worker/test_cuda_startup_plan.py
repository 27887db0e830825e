"""Scheduler side of the CUDA start-up path: one source of numbers.

The engine core's path (worker alignment and specs, layout resolution,
``get_kv_cache_configs``, the scheduler config, the capacity line, the
scheduler's ``KVCacheManager`` and its arena) must give the numbers
``vllm-hybrid plan <dir> --device cuda`` prints for the same inputs.
"""

from __future__ import annotations

import json

import pytest
from cuda_startup import (
    MAX_MODEL_LEN,
    MiB,
    backend_class,
    plan_engine_core,
    start_worker,
)

from vllm_hybrid.tools.plan import main as plan_main
from vllm_hybrid.v1.core.pooled.capacity import (
    max_state_blocks_per_request,
    pooled_capacity,
)
from vllm_hybrid.v1.core.pooled.coordinator import (
    PooledHybridKVCacheCoordinator,
    arena_of,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

BUDGET = 256 * MiB

#: (block size, KV cache dtype, attention backend pooled mode meets there)
CASES = [
    pytest.param(16, "auto", "FLASH_ATTN", id="bf16-16"),
    pytest.param(32, "auto", "FLASH_ATTN", id="bf16-32"),
    pytest.param(16, "turboquant_k8v4", "TURBOQUANT", id="tq-16"),
    pytest.param(32, "turboquant_k8v4", "TURBOQUANT", id="tq-32"),
]

#: Pages per attention layer, from the checkpoint's shape: 2 KV heads x 256,
#: K and V; bf16 2 B per value; TurboQuant k8v4 packs 388 B per head and token
#: (256 B fp8 keys, 128 B 4-bit values, 4 B scale and zero).
ATTENTION_PAGE_PER_TOKEN = {"auto": 2 * 256 * 2 * 2, "turboquant_k8v4": 2 * 388}
#: One GDN layer's state at TP 1: conv 3 x (2 x 16 x 128 + 32 x 128) bf16 and
#: SSM 32 x 128 x 128 fp32.
GDN_STATE_PAGE = 3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4


def _plan_json(qwen36_dir, block: int, dtype: str, capsys) -> dict:
    argv = [str(qwen36_dir), "--device", "cuda", "--kv-cache-memory", str(BUDGET)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(block)]
    argv += ["--kv-cache-dtype", dtype, "--json"]
    capsys.readouterr()
    assert plan_main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def engine_cores(cuda_configs):
    """``engine_cores(block, dtype, backend[, budget]) -> (startup, engine
    core)``."""
    done: dict[tuple, tuple] = {}

    def get(block: int, dtype: str, backend: str, budget: int = BUDGET):
        key = (block, dtype, backend, budget)
        if key not in done:
            request, config = cuda_configs(budget, block, dtype)
            startup = start_worker(request, backend_class(backend), base=config)
            done[key] = (startup, plan_engine_core(startup))
        return done[key]

    return get


def test_hand_derived_figures_bf16_16(engine_cores):
    """256 MiB, 16-token blocks, bf16 KV, CUDA graphs, by hand:

    * token block: 10 layers x 16 tokens x 2,048 B = 327,680 B; 268,435,456 B
      hold 819 token ids;
    * state block: 30 layers x 2,146,304 B = 64,389,120 B; 4 state ids;
    * null region (CUDA graphs): max of both blocks = 64,389,120 B, so the
      first token id is ceil(64,389,120 / 327,680) = 197;
    * a lone request needs 1 state block (align mode), so the highest state
      floor is 3: token ids end at 3 x 64,389,120 // 327,680 = 589, 392
      blocks, 6,272 tokens;
    * concurrency: (268,435,456 - 64,389,120) / (128 x 327,680 + 2 x
      64,389,120) = 204,046,336 / 170,721,280.
    """
    startup, core = engine_cores(16, "auto", "FLASH_ATTN")
    config = core.worker_configs[0]
    layout = config.layout
    assert (layout.token_block_bytes, layout.num_token_ids) == (327_680, 819)
    assert (layout.state_block_bytes, layout.num_state_ids) == (64_389_120, 4)
    assert layout.first_token_id == 197
    assert layout.max_state_floor == 3
    assert layout.token_ids_at(3) == range(197, 589)
    cache = startup.vllm_config.cache_config
    assert cache.kv_cache_size_tokens == 6_272
    assert cache.kv_cache_max_concurrency == pytest.approx(204_046_336 / 170_721_280)


def test_odd_budget_is_planned_alike(engine_cores, qwen36_dir, capsys):
    """A budget that is no multiple of 256 B: both paths round the arena
    down alike."""
    budget = BUDGET + 1_000
    startup, core = engine_cores(16, "auto", "FLASH_ATTN", budget)
    config = core.worker_configs[0]
    assert config.arena_bytes == BUDGET + 768
    argv = [str(qwen36_dir), "--device", "cuda", "--kv-cache-memory", str(budget)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--json"]
    capsys.readouterr()
    assert plan_main(argv) == 0
    pooled = json.loads(capsys.readouterr().out)["pooled"]
    assert [p["num_blocks"] for p in pooled["pools"]] == [
        p.num_blocks for p in config.pools
    ]
    cache = startup.vllm_config.cache_config
    assert pooled["token_capacity"] == cache.kv_cache_size_tokens
    assert pooled["max_concurrency"] == cache.kv_cache_max_concurrency


@pytest.mark.parametrize(("block", "dtype", "backend"), CASES)
def test_engine_core_plans_pooled_mode_for_the_fp8_checkpoint(
    engine_cores, block, dtype, backend
):
    startup, core = engine_cores(block, dtype, backend)
    model = startup.vllm_config.model_config
    assert model.quantization == "fp8"
    assert startup.vllm_config.cache_config.mamba_ssm_cache_dtype == "float32"
    config = core.worker_configs[0]
    assert isinstance(config, PooledKVCacheConfig)
    assert isinstance(core.scheduler_config, PooledKVCacheConfig)
    token_group, state_group = config.kv_cache_groups
    assert len(token_group.layer_names) == 10
    assert len(state_group.layer_names) == 30
    # natural pages: no inflation, no padding
    assert token_group.kv_cache_spec.block_size == block
    page = token_group.kv_cache_spec.page_size_bytes
    assert page == block * ATTENTION_PAGE_PER_TOKEN[dtype]
    assert state_group.kv_cache_spec.page_size_bytes == GDN_STATE_PAGE
    token = config.pool_by_kind(PoolKind.TOKEN)
    state = config.pool_by_kind(PoolKind.STATE)
    assert token.block_bytes >= 10 * page
    assert state.block_bytes >= 30 * GDN_STATE_PAGE
    # CUDA graphs pad decode batches with state id 0: the null blocks must not
    # overlap owned blocks, so [0, max(token block, state block)) is reserved
    assert not config.null_blocks_overlap
    assert config.null_region_bytes == max(token.block_bytes, state.block_bytes)
    assert config.arena_bytes == BUDGET
    # one plan line, naming the pools
    assert any("KV cache plan (pooled)" in line for line in core.plan_lines)


@pytest.mark.parametrize(("block", "dtype", "backend"), CASES)
def test_plan_tool_prints_the_engine_cores_numbers(
    engine_cores, qwen36_dir, capsys, block, dtype, backend
):
    startup, core = engine_cores(block, dtype, backend)
    config = core.worker_configs[0]
    cache = startup.vllm_config.cache_config
    printed = _plan_json(qwen36_dir, block, dtype, capsys)
    pooled = printed["pooled"]
    assert pooled["error"] is None
    assert printed["kv_cache_memory"] == config.arena_bytes == BUDGET
    pools = (config.pool_by_kind(PoolKind.TOKEN), config.pool_by_kind(PoolKind.STATE))
    assert pooled["pools"] == [
        {"kind": str(p.kind), "num_blocks": p.num_blocks, "block_bytes": p.block_bytes}
        for p in pools
    ]
    assert pooled["num_blocks"] == config.num_blocks
    assert pooled["attention_block_size"] == block
    assert pooled["state_padding_bytes"] == 0
    # the engine stores what it logs; the tool prints the same figures
    assert pooled["token_capacity"] == cache.kv_cache_size_tokens
    assert pooled["max_concurrency"] == cache.kv_cache_max_concurrency
    capacity = pooled_capacity(config, MAX_MODEL_LEN)
    assert cache.kv_cache_size_tokens == capacity.token_capacity
    at_len = pooled["at_prompt_len"][str(MAX_MODEL_LEN)]
    assert at_len["bytes_per_request"] == capacity.bytes_per_request
    (line,) = [line for line in core.capacity_lines if "KV cache size" in line]
    assert line.startswith(f"GPU KV cache size: {capacity.token_capacity:,} tokens")
    assert f"{MAX_MODEL_LEN:,} tokens per request: {capacity.max_concurrency:.2f}x" in (
        line
    )


@pytest.mark.parametrize(("block", "dtype", "backend"), CASES)
def test_scheduler_arena_is_the_planned_one(engine_cores, block, dtype, backend):
    startup, core = engine_cores(block, dtype, backend)
    config = core.scheduler_config
    manager = core.manager
    assert isinstance(manager.coordinator, PooledHybridKVCacheCoordinator)
    arena = arena_of(manager)
    assert arena is not None
    assert arena.layout == config.layout
    usage = arena.usage()
    assert usage.arena_bytes == BUDGET
    token, state = usage.pools
    assert (token.pool, token.page_bytes) == (
        "token",
        config.pool_by_kind(PoolKind.TOKEN).block_bytes,
    )
    assert (state.pool, state.page_bytes) == (
        "state",
        config.pool_by_kind(PoolKind.STATE).block_bytes,
    )
    assert token.used_blocks == state.used_blocks == 0
    layout = config.layout
    assert token.owned_blocks == layout.token_capacity_at(layout.initial_state_floor)
    assert state.owned_blocks == layout.state_capacity_at(layout.initial_state_floor)
    # KVCacheManager's block pool is the token pool
    assert manager.block_pool is arena.token_pool
    # align mode (prefix caching on): two state blocks per running request
    state_spec = config.kv_cache_groups[1].kv_cache_spec
    assert state_spec.mamba_cache_mode == "align"
    assert config.max_state_blocks_per_request == 2
    assert max_state_blocks_per_request(state_spec) == 2
