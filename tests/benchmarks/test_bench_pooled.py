"""Fast checks of the pure helpers of the pooled benchmark (no engine).

The benchmark itself (``benchmarks/bench_pooled.py``, code in
``benchmarks/pooled``) takes many minutes; these tests pin down the parts whose
mistakes would silently skew its numbers: the bytes
arithmetic on real upstream spec classes, pool reading on real block pools and
arenas, and formatting.
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from benchmarks.pooled import (
    cli,
    config,
    driver,
    pools,
    report,
    same_tokens,
    worker,
    workloads,
)
from vllm_hybrid.tools.plan.geometry import KVGeometry, kv_geometry
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout
from vllm_hybrid.v1.core.pooled.usage import PoolUsage

# ---------------------------------------------------------------------------
# settings (the prompts are tests/tools/test_workloads.py's)
# ---------------------------------------------------------------------------


def test_preempt_budget_defaults_per_model_and_override():
    cfg = config.BenchConfig()
    assert same_tokens.preempt_budget_bytes(cfg, "qwen3_5") == 20 * 2**20
    assert same_tokens.preempt_budget_bytes(cfg, "qwen3_next") == 12 * 2**20
    assert same_tokens.preempt_budget_bytes(cfg, "dense") == 16 * 2**20
    fixed = config.BenchConfig(preempt_budget_bytes=3 * 2**20)
    assert same_tokens.preempt_budget_bytes(fixed, "qwen3_5") == 3 * 2**20
    args = cli.build_parser().parse_args(["--preempt-budget-mib", "3"])
    assert cli.config_from_args(args).preempt_budget_bytes == 3 * 2**20


# ---------------------------------------------------------------------------
# bytes arithmetic on real upstream spec classes
# ---------------------------------------------------------------------------


def _qwen3_5_like_config(block_size: int = 256, padded: int | None = 524288):
    """A scheduler-side KVCacheConfig shaped like the tiny qwen3_5 model:
    3 GDN groups of 2 layers and 1 attention group of 2 layers."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    attn = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
    )
    gdn = MambaSpec(
        block_size=block_size,
        shapes=((3, 1024), (4, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=padded,
    )
    groups = [
        KVCacheGroupSpec(
            [f"layers.{i}.linear_attn", f"layers.{i + 4}.linear_attn"], gdn
        )
        for i in range(3)
    ]
    groups.append(KVCacheGroupSpec(["layers.3.attn", "layers.7.attn"], attn))
    num_blocks = 48
    block_bytes = 2 * attn.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=block_bytes * num_blocks,
            layers=g.layer_names,
            layer_stride=attn.page_size_bytes * num_blocks,
            block_stride=attn.page_size_bytes,
        )
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def test_geometry_uses_unpadded_sizes():
    geometry = kv_geometry(_qwen3_5_like_config())
    # 2 layers x 2 KV heads x (K 256 + V 256) x 2 bytes
    assert geometry.attn_bytes_per_token == 2 * 2 * 512 * 2 == 4096
    # per GDN layer: conv 3x1024 bf16 + ssm 4x128x128 fp32, not the 524288 pad
    per_layer = 3 * 1024 * 2 + 4 * 128 * 128 * 4
    assert geometry.state_bytes_per_request == 6 * per_layer == 1_609_728
    assert (geometry.num_attention_layers, geometry.num_state_layers) == (2, 6)
    assert geometry.other_layers == ()


def test_geometry_does_not_depend_on_block_size_or_padding():
    a = kv_geometry(_qwen3_5_like_config(256, 524288))
    b = kv_geometry(_qwen3_5_like_config(16, None))
    assert a.attn_bytes_per_token == b.attn_bytes_per_token
    assert a.state_bytes_per_request == b.state_bytes_per_request


def test_bytes_needed_and_token_bound():
    geometry = kv_geometry(_qwen3_5_like_config())
    assert geometry.bytes_needed([]) == 0
    assert geometry.bytes_needed([100, 300]) == 400 * 4096 + 2 * 1_609_728
    # (5 MiB - one state) / bytes per token, rounded down
    assert geometry.token_bound(5 * 2**20) == (5 * 2**20 - 1_609_728) // 4096 == 887
    assert geometry.token_bound(1_000_000) == 0


def test_shared_pool_block_bytes_from_aliasing_tensors():
    from vllm_hybrid.v1.core.pooled.capacity import shared_block_bytes

    assert shared_block_bytes(_qwen3_5_like_config()) == 2**20


# ---------------------------------------------------------------------------
# pool reading (real block pools and arenas)
# ---------------------------------------------------------------------------


def _upstream_scheduler(used: int):
    """A scheduler's KV cache as upstream builds it (one ``BlockPool`` of 48
    ids, one of them the null block), ``used`` blocks held by requests."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kv_cache_config = _qwen3_5_like_config()
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
    assert pools.kv_layout_name([pool]) == "single"
    assert pools.pool_record(pool) == {
        "name": "shared",
        "block_bytes": 2**20,
        "num_blocks_total": 47,
        "num_free": 40,
    }
    assert pools.coupled_evictions(scheduler) is None


def test_kv_pools_pooled_mode_reads_the_arena_usage():
    arena = KVArena(SMALL, enable_caching=False, hash_block_size=16)
    arena.token_pool.get_new_blocks(4)
    arena.state_pool.get_new_blocks(2)
    views = pools.kv_pools(_pooled_scheduler(arena))
    assert views == [PoolUsage("token", 4, 9, 4), PoolUsage("state", 10, 5, 2)]
    assert views == list(arena.usage().pools)
    assert sum(v.used_bytes for v in views) == 4 * 4 + 2 * 10
    assert pools.kv_layout_name(views) == "pooled"
    assert [pools.pool_record(v)["num_free"] for v in views] == [5, 3]


def test_sample_kv_reserves_the_used_blocks_of_every_pool():
    arena = KVArena(SMALL, enable_caching=False, hash_block_size=16)
    arena.token_pool.get_new_blocks(3)
    arena.state_pool.get_new_blocks(1)
    scheduler = _pooled_scheduler(arena)
    scheduler.running = [SimpleNamespace(num_computed_tokens=5)]
    geometry = KVGeometry(0.5, 7, 1, 1)
    sample = pools.sample_kv(scheduler, geometry, step=3)
    assert sample == pools.KVSample(3, 1, 3 * 4 + 10, 5 * 0.5 + 7)


def test_coupled_evictions_only_with_coupled_prefix_caches():
    uncoupled = KVArena(SMALL, enable_caching=True, hash_block_size=16)
    assert pools.coupled_evictions(_pooled_scheduler(uncoupled)) is None
    coupled = KVArena(SMALL, enable_caching=True, hash_block_size=16)
    coupled.couple_prefix_caches({0: 16})
    assert pools.coupled_evictions(_pooled_scheduler(coupled)) == 0


# ---------------------------------------------------------------------------
# search and formatting
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 249, 633, 2553, 3000])
def test_longest_completing_finds_the_limit(limit):
    best, probed = workloads.longest_completing(lambda n: n <= limit, 1, 3000)
    assert best == limit
    assert len(probed) <= 12


def test_ratio_rules():
    assert report.ratio(18, 11) == pytest.approx(18 / 11)
    assert report.ratio(5, 0) is None
    assert report.ratio("pooled", "single") is None
    assert report.ratio(True, False) is None
    assert report.ratio(None, 3) is None


def test_format_value():
    assert report.format_value(None) == "-"
    assert report.format_value(True) == "yes"
    assert report.format_value(2553) == "2,553"
    assert report.format_value(0.5812) == "0.581"
    assert report.format_value(12.345) == "12.35"
    assert report.format_value(123.45) == "123.5"
    assert report.format_value(35410.2) == "35,410"
    assert report.format_value("x" * 60).endswith("...")


def test_format_table_aligns_and_shows_ratios():
    rows = [
        report.Row("qwen3_5", "many_short", "peak running requests", 11, 22),
        report.Row("qwen3_5", "engine main", "kv layout", "single", "pooled"),
    ]
    text = report.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == list(report.TABLE_HEADER)
    assert lines[0].endswith("overlay/upstream")
    assert lines[2].endswith("2.00x")
    assert lines[3].endswith("-")
    assert len({len(line) for line in lines[:3]}) == 1


def test_tokens_verdict_and_result_parsing():
    verdict = same_tokens.tokens_verdict
    assert verdict([[1, 2], [3]], [[1, 2], [4]]) == "1/2 prompts equal"
    assert verdict([[1]], []) == "0/1 prompts equal"
    text = 'log line\nBENCH_RESULT {"a": 1}\nBENCH_RESULT {"a": 2}\n'
    assert driver.parse_result(text) == {"a": 2}
    assert driver.parse_result("nothing") is None


def test_worker_env_sets_the_switch_and_in_process_engines():
    env = driver.worker_env("upstream")
    assert env["VLLM_HYBRID_KV"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert driver.worker_env("overlay")["VLLM_HYBRID_KV"] == "1"


def test_quick_config_and_cli_round_trip():
    args = cli.build_parser().parse_args(["--quick", "--models", "qwen3_5"])
    cfg = cli.config_from_args(args)
    assert cfg.many_short_requests == 8 and cfg.enforce_eager
    assert args.models == ["qwen3_5"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--workloads", "nope"])


def test_host_independent_state_dtype_and_cached_only_options():
    parse = cli.build_parser().parse_args
    cfg = cli.config_from_args(parse([]))
    assert (cfg.mamba_ssm_cache_dtype, cfg.same_tokens_uncached) == ("float32", True)
    spec = worker.engine_specs("m", "qwen3_5", cfg)["main"]
    assert spec.llm_kwargs()["mamba_ssm_cache_dtype"] == "float32"
    cfg = cli.config_from_args(
        parse(["--mamba-ssm-cache-dtype", "auto", "--same-tokens-cached-only"])
    )
    assert (cfg.mamba_ssm_cache_dtype, cfg.same_tokens_uncached) == ("auto", False)
    with pytest.raises(SystemExit):
        parse(["--mamba-ssm-cache-dtype", "int8"])


def test_first_difference_gap_reads_the_gap_where_tokens_first_differ():
    run = {
        "tokens": [[1, 2, 3], [4, 5, 6], [7, 8]],
        "top2_gaps": [[0.5, 0.25, 0.125], [0.9, 0.8, 0.7], [0.3, 0.2]],
    }
    other = [[1, 9, 3], [4, 5, 6], [7, 8]]
    assert same_tokens.first_difference_gap(run, other) == "0.2500"
    other = [[1, 9, 3], [4, 5, 0], [7, 8]]  # the largest gap over prompts
    assert same_tokens.first_difference_gap(run, other) == "0.7000"
    assert same_tokens.first_difference_gap(run, run["tokens"]) == "-"


def test_worker_env_pins_threads_only_when_asked(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = driver.worker_env("overlay")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default
    assert "OMP_NUM_THREADS" not in default
    one = driver.worker_env("upstream", 1)
    assert (one["OMP_NUM_THREADS"], one["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "0")
    two = driver.worker_env("upstream", 2)
    assert (two["OMP_NUM_THREADS"], two["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "0-1")
    moved = driver.worker_env("upstream", 2, first_core=4)
    assert moved["VLLM_CPU_OMP_THREADS_BIND"] == "4-5"
    assert driver.worker_env("upstream", 1, first_core=1)[
        "VLLM_CPU_OMP_THREADS_BIND"
    ] == ("1")


def test_concurrent_pinned_workers_get_separate_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    slots = driver.CoreSlots(2)
    with slots.first_core(1) as a, slots.first_core(1) as b:
        assert sorted([a, b]) == [0, 1]
    with slots.first_core(2) as a, slots.first_core(2) as b:
        assert sorted([a, b]) == [0, 2]
    # a slot is given back when its worker ends
    for _ in range(3):
        with slots.first_core(1) as a:
            assert a in (0, 1)
    # more cores asked for than the machine has: wrap around
    with driver.CoreSlots(3).first_core(3) as a:
        assert a == 0


def test_same_tokens_gets_its_own_single_thread_workers():
    cfg = config.BenchConfig()
    jobs = driver.worker_jobs(["m"], ["many_short", "same_tokens"], cfg)
    assert [(j.mode, j.workloads, j.threads) for j in jobs] == [
        ("upstream", ("many_short",), 0),
        ("upstream", ("same_tokens",), 1),
        ("overlay", ("many_short",), 0),
        ("overlay", ("same_tokens",), 1),
    ]
    assert jobs[1].name == "m-upstream-same_tokens" and jobs[0].name == "m-upstream"
    # only same_tokens: no empty main worker
    only = driver.worker_jobs(["m"], ["same_tokens"], cfg)
    assert [j.threads for j in only] == [1, 1]
    # threads 0: everything in the main workers, as before
    shared = driver.worker_jobs(
        ["m"], ["many_short", "same_tokens"], replace(cfg, same_tokens_threads=0)
    )
    assert [(j.workloads, j.threads) for j in shared] == [
        (("many_short", "same_tokens"), 0)
    ] * 2


def test_merge_runs_joins_the_workers_of_one_model_and_mode():
    def run(mode, workloads, engines, errors=(), rc=0):
        report = {
            "workloads": workloads,
            "engines": engines,
            "geometry": None if "same_tokens" in workloads else {"g": 1},
            "errors": list(errors),
            "tracebacks": {},
        }
        return driver.WorkerRun("m", mode, rc, 2.0, f"{mode}.log", report)

    main = run("overlay", {"many_short": {"x": 1}}, {"main": {"start_s": 1}})
    same = run(
        "overlay",
        {"same_tokens": {"y": 2}},
        {"main": {"start_s": 9}, "no_pc": {"start_s": 3}},
        errors=["boom"],
        rc=1,
    )
    merged = driver.merge_runs([main, same])
    (key,) = merged
    out = merged[key]
    assert key == ("m", "overlay")
    assert set(out.report["workloads"]) == {"many_short", "same_tokens"}
    # the main worker's description of an engine both opened wins
    assert out.report["engines"] == {"main": {"start_s": 1}, "no_pc": {"start_s": 3}}
    assert out.report["geometry"] == {"g": 1}
    assert out.report["errors"] == ["boom"]
    assert (out.returncode, out.wall_s) == (1, 4.0)
    assert driver.merge_runs([main])[key] is main


def test_same_tokens_threads_option_is_checked():
    parse = cli.build_parser().parse_args
    assert cli.config_from_args(parse([])).same_tokens_threads == 1
    assert (
        cli.config_from_args(parse(["--same-tokens-threads", "0"])).same_tokens_threads
        == 0
    )
    with pytest.raises(SystemExit, match="--same-tokens-threads"):
        cli.config_from_args(parse(["--same-tokens-threads", "-1"]))
    with pytest.raises(SystemExit, match="--same-tokens-threads"):
        cli.config_from_args(parse(["--same-tokens-threads", "4096"]))


def test_four_modes_compare_upstream_best_and_the_single_pool():
    """``--modes``: upstream with the flags a user tunes, the overlay's single
    pool and pooled mode, one worker each, every engine with its own flags."""
    args = cli.build_parser().parse_args(
        [
            "--modes",
            "upstream,upstream_best,single,overlay",
            "--prefix-match-unit",
            "32",
            "--prefix-cache-retention-interval",
            "none",
            "--prefill-checkpoint-interval",
            "0",
        ]
    )
    cfg = cli.config_from_args(args)
    jobs = driver.worker_jobs(["m"], ["multi_turn"], cfg)
    assert [j.mode for j in jobs] == ["upstream", "upstream_best", "single", "overlay"]
    assert [driver.worker_env(j.mode)["VLLM_HYBRID_KV"] for j in jobs] == list("0011")
    kwargs = {
        mode: worker.engine_specs("m", "qwen3_5", cfg, mode)["main"].llm_kwargs()
        for mode in cfg.modes
    }
    best = kwargs["upstream_best"]
    assert (best["prefix_match_unit"], best["prefix_cache_retention_interval"]) == (
        32,
        None,
    )
    assert "prefix_match_unit" not in kwargs["upstream"]
    assert "prefix_cache_retention_interval" not in kwargs["upstream"]
    assert kwargs["single"]["additional_config"]["hybrid_kv"]["pooled"] is False
    pooled = kwargs["overlay"]["additional_config"]["hybrid_kv"]
    assert "pooled" not in pooled and pooled["prefill_checkpoint_interval"] == 0
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--modes", "upstream,nope"])
