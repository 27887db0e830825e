"""Fast checks of the pure helpers of the pooled benchmark (no engine).

The benchmark itself (``benchmarks/bench_pooled.py``, code in
``benchmarks/pooled``) takes many minutes; these tests pin down the parts whose
mistakes would silently skew its numbers: the bytes
arithmetic on real upstream spec classes, pool reading on real block pools and
arenas, and formatting.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from engine_utils import qwen3_5_like_kv_config

from benchmarks import harness
from benchmarks.pooled import admission, cli, config, pools, report, worker, workloads
from vllm_hybrid.tools.plan.geometry import KVGeometry, kv_geometry
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout
from vllm_hybrid.v1.core.pooled.usage import PoolUsage

# ---------------------------------------------------------------------------
# bytes arithmetic on real upstream spec classes
# ---------------------------------------------------------------------------


def test_geometry_uses_unpadded_sizes():
    geometry = kv_geometry(qwen3_5_like_kv_config())
    # 2 layers x 2 KV heads x (K 256 + V 256) x 2 bytes
    assert geometry.attn_bytes_per_token == 2 * 2 * 512 * 2 == 4096
    # per GDN layer: conv 3x1024 bf16 + ssm 4x128x128 fp32, not the 524288 pad
    per_layer = 3 * 1024 * 2 + 4 * 128 * 128 * 4
    assert geometry.state_bytes_per_request == 6 * per_layer == 1_609_728
    assert (geometry.num_attention_layers, geometry.num_state_layers) == (2, 6)
    assert geometry.other_layers == ()


def test_geometry_does_not_depend_on_block_size_or_padding():
    a = kv_geometry(qwen3_5_like_kv_config(256, 524288))
    b = kv_geometry(qwen3_5_like_kv_config(16, None))
    assert a.attn_bytes_per_token == b.attn_bytes_per_token
    assert a.state_bytes_per_request == b.state_bytes_per_request


def test_bytes_needed_and_token_bound():
    geometry = kv_geometry(qwen3_5_like_kv_config())
    assert geometry.bytes_needed([]) == 0
    assert geometry.bytes_needed([100, 300]) == 400 * 4096 + 2 * 1_609_728
    # (5 MiB - one state) / bytes per token, rounded down
    assert geometry.token_bound(5 * 2**20) == (5 * 2**20 - 1_609_728) // 4096 == 887
    assert geometry.token_bound(1_000_000) == 0


def test_shared_pool_block_bytes_from_aliasing_tensors():
    from vllm_hybrid.v1.core.pooled.capacity import shared_block_bytes

    assert shared_block_bytes(qwen3_5_like_kv_config()) == 2**20


# ---------------------------------------------------------------------------
# pool reading (real block pools and arenas)
# ---------------------------------------------------------------------------


def _upstream_scheduler(used: int):
    """A scheduler's KV cache as upstream builds it (one ``BlockPool`` of 48
    ids, one of them the null block), ``used`` blocks held by requests."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kv_cache_config = qwen3_5_like_kv_config()
    manager = KVCacheManager(
        kv_cache_config,
        max_model_len=4096,
        scheduler_block_size=256,
        hash_block_size=256,
        enable_caching=False,
    )
    manager.block_pool.get_new_blocks(used)
    return SimpleNamespace(kv_cache_manager=manager, kv_cache_config=kv_cache_config)


#: 100 B arena, 4 B token and 10 B state blocks, at least 2 of each, boundary
#: at 50 B: the token pool owns ids 3..11 (9 blocks), the state pool ids 5..9
#: (5 blocks).
SMALL = ArenaLayout(100, 4, 10, 2, 2, 50)


def _pooled_scheduler(arena: KVArena):
    """A scheduler whose coordinator holds ``arena``, as pooled mode's does."""
    coordinator = SimpleNamespace(arena=arena)
    return SimpleNamespace(kv_cache_manager=SimpleNamespace(coordinator=coordinator))


def test_kv_pools_upstream_single_pool_excludes_null_block():
    scheduler = _upstream_scheduler(used=7)
    (pool,) = pools.kv_pools(scheduler)
    assert pool == PoolUsage("shared", 2**20, 47, 7)
    assert pool.used_bytes == 7 * 2**20 and pool.owned_bytes == 47 * 2**20


def test_kv_pools_pooled_mode_reads_the_arena_usage():
    arena = KVArena(SMALL, enable_caching=False, hash_block_size=16)
    arena.token_pool.get_new_blocks(4)
    arena.state_pool.get_new_blocks(2)
    views = pools.kv_pools(_pooled_scheduler(arena))
    assert views == [PoolUsage("token", 4, 9, 4), PoolUsage("state", 10, 5, 2)]
    assert views == list(arena.usage().pools)
    assert sum(v.used_bytes for v in views) == 4 * 4 + 2 * 10


def test_sample_kv_reserves_the_used_blocks_of_every_pool():
    arena = KVArena(SMALL, enable_caching=False, hash_block_size=16)
    arena.token_pool.get_new_blocks(3)
    arena.state_pool.get_new_blocks(1)
    scheduler = _pooled_scheduler(arena)
    scheduler.running = [SimpleNamespace(num_computed_tokens=5)]
    scheduler.waiting = [SimpleNamespace(), SimpleNamespace()]
    geometry = KVGeometry(0.5, 7, 1, 1)
    sample = pools.sample_kv(scheduler, geometry, step=3)
    assert sample == pools.KVSample(3, 1, 3 * 4 + 10, 5 * 0.5 + 7, waiting=2)


# ---------------------------------------------------------------------------
# search and formatting
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 249, 633, 2553, 3000])
def test_longest_completing_finds_the_limit(limit):
    best, probed = workloads.longest_completing(lambda n: n <= limit, 1, 3000)
    assert best == limit
    assert len(probed) <= 12


def test_ratio_rules():
    assert harness.ratio(18, 11) == pytest.approx(18 / 11)
    assert harness.ratio(5, 0) is None
    assert harness.ratio("pooled", "single") is None
    assert harness.ratio(True, False) is None
    assert harness.ratio(None, 3) is None


def test_format_value():
    assert report.format_value(None) == "-"
    assert report.format_value(True) == "yes"
    assert report.format_value(2553) == "2,553"
    assert report.format_value(0.5812) == "0.581"
    assert report.format_value(12.345) == "12.35"
    assert report.format_value(123.45) == "123.5"
    assert report.format_value(35410.2) == "35,410"
    assert report.format_value("x" * 60).endswith("...")


def test_format_table_is_markdown_with_ratios():
    rows = [
        report.Row("qwen3_5", "many_short", "peak running requests", 11, 22),
        report.Row("qwen3_5", "engine main", "kv layout", "single", "pooled"),
    ]
    lines = report.format_table(rows).splitlines()
    assert lines[0] == "| " + " | ".join(report.TABLE_HEADER) + " |"
    assert lines[0].endswith("| overlay/upstream |")
    assert lines[1] == "| --- " * 6 + "|"
    assert (
        lines[2] == "| qwen3_5 | many_short | peak running requests | 11 | 22 | 2.00x |"
    )
    assert lines[3].endswith("| single | pooled | - |")


def test_quick_config_and_cli_round_trip():
    args = cli.build_parser().parse_args(["--quick", "--models", "qwen3_5"])
    cfg = cli.config_from_args(args)
    assert cfg.many_short_requests == 8 and cfg.enforce_eager
    assert args.models == ["qwen3_5"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--workloads", "nope"])


def test_host_independent_state_dtype_option():
    parse = cli.build_parser().parse_args
    cfg = cli.config_from_args(parse([]))
    assert cfg.mamba_ssm_cache_dtype == "float32"
    main = worker.engine_specs("m", "qwen3_5", cfg)["main"]
    assert main["mamba_ssm_cache_dtype"] == "float32"
    cfg = cli.config_from_args(parse(["--mamba-ssm-cache-dtype", "auto"]))
    assert cfg.mamba_ssm_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse(["--mamba-ssm-cache-dtype", "int8"])


def test_a_mode_may_run_its_own_kv_cache_dtype():
    """``--modes overlay,overlay:turboquant_k8v4``: pooled mode at both dtypes,
    the ratio rows TurboQuant/auto; every other engine argument the same."""
    args = cli.build_parser().parse_args(
        ["--modes", "overlay,overlay:turboquant_k8v4", "--workloads", "one_long"]
    )
    cfg = cli.config_from_args(args)
    auto, tq = (worker.engine_specs("m", "qwen3_5", cfg, m) for m in cfg.modes)
    assert [config.overlay_mode(mode) for mode in cfg.modes] == [1, 1]
    for name in ("main", "one_long_pc_off", "one_long_pc_on"):
        assert (auto[name]["kv_cache_dtype"], tq[name]["kv_cache_dtype"]) == (
            "auto",
            "turboquant_k8v4",
        )
        assert {**tq[name], "kv_cache_dtype": "auto"} == auto[name]
    long = auto["one_long_pc_off"]
    assert (long["kv_cache_memory_bytes"], long["max_model_len"]) == (5 * 2**20, -1)
    assert (long["block_size"], long["max_num_seqs"]) == (32, 1)
    assert auto["one_long_pc_on"]["enable_prefix_caching"] is True
    assert "mamba_block_size" not in auto["one_long_pc_on"]
    for gone in ("nope:auto", "upstream_best", "single"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--modes", gone])


def test_workloads_many_short_and_one_long_run_by_default():
    """Workloads that left the benchmark: chat_server and multi_turn are
    ``vllm-hybrid simulate --workload ...``'s (the same workloads and counts;
    tests/tools/test_multi_turn_counts.py pins multi_turn's on real engines),
    same_tokens is tests/v1/core/pooled/test_same_tokens.py and
    tests/v1/core/test_turn_end_retention.py checks where a follow-up turn
    hits (two_turn). The admission workload runs when asked for by name."""
    args = cli.build_parser().parse_args([])
    assert args.workloads == list(config.DEFAULT_WORKLOADS)
    assert args.workloads == ["many_short", "one_long"]
    assert config.WORKLOADS == ("many_short", "one_long", "admission")
    for gone in ("chat_server", "two_turn", "same_tokens", "multi_turn"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--workloads", gone])


# ---------------------------------------------------------------------------
# the admission workload: byte limit arithmetic and acceptance
# ---------------------------------------------------------------------------


def test_max_window_counts_consecutive_sizes_that_fit():
    assert admission.max_window([], 10) == 0
    assert admission.max_window([11], 10) == 0
    assert admission.max_window([4, 4, 4], 10) == 2
    # the best run is in the middle: 3 + 2 + 1 + 4 = 10
    assert admission.max_window([9, 3, 2, 1, 4, 8], 10) == 4


def _pooled_config(arena_bytes: int, token_block: int = 32):
    """The tiny qwen3_5's pooled plan at 32-token attention blocks: one token
    group of 2 layers (131,072 B per id), one align-mode state group of 6
    GDN layers (1,609,728 B per id), the null blocks overlapping."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from vllm_hybrid.v1.core.pooled.spec import (
        KVPoolSpec,
        PooledKVCacheConfig,
        PoolKind,
    )

    attn = FullAttentionSpec(
        block_size=token_block, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
    )
    gdn = MambaSpec(
        block_size=token_block,
        shapes=((3, 1024), (4, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    groups = [
        KVCacheGroupSpec(["layers.3.attn", "layers.7.attn"], attn),
        KVCacheGroupSpec([f"layers.{i}.linear_attn" for i in (0, 1, 2, 4, 5, 6)], gdn),
    ]
    token_bytes, state_bytes = 2 * attn.page_size_bytes, 6 * gdn.page_size_bytes
    layout = ArenaLayout(
        arena_bytes, token_bytes, state_bytes, 1, 1, arena_bytes // 2, True
    )
    pools = [
        KVPoolSpec(PoolKind.TOKEN, (0,), token_bytes, layout.num_token_ids),
        KVPoolSpec(PoolKind.STATE, (1,), state_bytes, layout.num_state_ids),
    ]
    return PooledKVCacheConfig(
        num_blocks=layout.num_token_ids,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        pools=pools,
        arena=layout,
        max_state_blocks_per_request=2,
    )


def test_pooled_byte_limit_counts_prompt_output_and_one_state_block():
    """48 MiB, the tiny qwen3_5 at 32-token blocks: a 239-token prompt with
    32 output tokens takes cdiv(271, 32) = 9 token blocks and one state
    block; the null region (one token block, the smaller, as the null
    blocks overlap) is not usable."""
    config = _pooled_config(48 * 2**20)
    assert config.layout.token_block_bytes == 131_072
    assert config.layout.state_block_bytes == 1_609_728
    limit = admission.pooled_byte_limit(config, [239, 159, 512], 32)
    assert limit.state_blocks_per_request == 1
    assert limit.usable_bytes == 48 * 2**20 - 131_072 == 50_200_576
    per_request = [9 * 131_072 + 1_609_728, 6 * 131_072 + 1_609_728]
    assert limit.footprints[:2] == tuple(per_request)
    assert limit.footprints[2] == 17 * 131_072 + 1_609_728
    # every one fits: three requests take 32 token blocks and 3 state blocks
    assert limit.window_concurrency == limit.first_wave == 3
    assert limit.mean_concurrency == pytest.approx(
        50_200_576 / ((32 * 131_072 + 3 * 1_609_728) / 3)
    )
    # align mode's copy target counted too: two state blocks each
    most = admission.pooled_byte_limit(config, [239, 159, 512], 32, "max")
    assert most.state_blocks_per_request == 2
    assert most.footprints[0] == 9 * 131_072 + 2 * 1_609_728


def test_pooled_byte_limit_at_the_budget_of_the_benchmark():
    """64 requests of the mean prompt, 2.92 MB each, fit 17 at a time."""
    config = _pooled_config(48 * 2**20)
    lens = [267] * 64
    limit = admission.pooled_byte_limit(config, lens, 32)
    footprint = 10 * 131_072 + 1_609_728  # cdiv(299, 32) = 10
    assert limit.footprints == (footprint,) * 64
    assert limit.window_concurrency == 50_200_576 // footprint == 17
    assert limit.mean_concurrency == pytest.approx(50_200_576 / footprint)


def test_acceptance_checks_the_three_targets():
    up = {"peak_running": 16, "preemptions": 29, "engine_steps": 170}
    met = {
        "peak_running": 17,
        "byte_limit": 17,
        "preemptions": 0,
        "engine_steps": 133,
        "waiting_running_over_byte_limit": 0.95,
    }
    checks = admission.acceptance(up, met)
    assert [c.met for c in checks] == [True, True, True, None]
    assert [round(c.value, 3) for c in checks] == [1.0, -29, 0.782, 0.95]
    assert checks[3].line().endswith(": 0.95 (no target)")
    missed = {
        "peak_running": 15,
        "byte_limit": 17,
        "preemptions": 30,
        "engine_steps": 166,
    }
    checks = admission.acceptance(up, missed)
    assert [c.met for c in checks[:3]] == [False, False, False]
    assert checks[0].line().endswith("(target >= 0.9): NOT met")
    assert admission.acceptance(up, {})[0].met is None


def test_diagnosis_lines_explain_the_reasons_they_name():
    probe = {
        "refusals": {"preempted: token_short_live_state_pins": 72},
        "admission_stops": {"watermark": 48},
        "preemptions_for": {"prefill, edge: both_short": 9},
        "state_blocks_held_request_steps": {1: 1996, 2: 127},
        "boundary_moves": {"state": 14, "token": 8},
        "token_blocks_moved": 55,
    }
    lines = admission.diagnosis_lines({"probe": probe})
    assert lines[0].endswith("preempted: token_short_live_state_pins x72")
    assert "watermark: " + admission.REASONS["watermark"] in lines
    assert "both_short: " + admission.REASONS["both_short"] in lines
    assert lines[3].endswith("(blocks: request-steps): 1: 1996, 2: 127")
    assert lines[-1] == (
        "boundary moves: state pool grew 14, token pool grew 8; "
        "live token blocks moved off it: 55"
    )
    assert admission.diagnosis_lines({}) == []


def test_admission_is_asked_for_by_name_at_its_own_block():
    parse = cli.build_parser().parse_args
    cfg = cli.config_from_args(parse(["--workloads", "admission"]))
    specs = worker.engine_specs("m", "qwen3_5", cfg)
    assert specs["admission"]["block_size"] == 32
    assert "block_size" not in specs["main"]
    assert {**specs["admission"], "block_size": None} == {
        **specs["main"],
        "block_size": None,
    }
    cfg = cli.config_from_args(
        parse(["--admission-block-size", "0", "--block-size", "64"])
    )
    assert worker.engine_specs("m", "qwen3_5", cfg)["admission"]["block_size"] == 64


def test_plan_refusal_names_what_pins_the_boundary():
    """The probe's read-only mirror of the boundary's plan, on a real arena:
    SMALL's token pool owns ids 3..11 and its state pool ids 5..9."""
    from vllm_hybrid.v1.core.pooled.policy.eviction import Reach

    arena = KVArena(SMALL, enable_caching=False, hash_block_size=16)
    boundary = arena.boundary
    reach = Reach.ANY
    assert admission.plan_refusal(boundary, 1, 1, [], reach) is None
    # every state block live: the state pool is short, and taking token ids
    # would leave the token pool short (8 of its 9 blocks live)
    arena.state_pool.get_new_blocks(5)
    arena.token_pool.get_new_blocks(8)
    assert admission.plan_refusal(boundary, 0, 1, [], reach) == (
        "state_short_token_would_run_short"
    )
    arena.token_pool.get_new_blocks(1)
    assert admission.plan_refusal(boundary, 1, 1, [], reach) == "both_short"
    # the token pool short while live state blocks sit next to the boundary
    arena = KVArena(SMALL, enable_caching=False, hash_block_size=16)
    arena.token_pool.get_new_blocks(9)
    arena.state_pool.get_new_blocks(5)
    held = [b for b in arena.state_pool.blocks if b.ref_cnt]
    far = [b for b in held if b.block_id != arena.boundary.state_floor]
    arena.state_pool.free_blocks(far)
    assert admission.plan_refusal(arena.boundary, 1, 0, [], reach) == (
        "token_short_live_state_pins"
    )
