"""Fast checks of the pure helpers of ``benchmarks/bench_pooled.py`` (no engine).

The benchmark itself takes many minutes; these tests pin down the parts whose
mistakes would silently skew its numbers: prompt determinism, the bytes
arithmetic on real upstream spec classes, the pool adapter and formatting.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from engine_utils import bench_pooled

bench = bench_pooled()

VOCAB = bench.allowed_token_ids(951, [0, 1, 2])


# ---------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------


def test_allowed_token_ids_skip_special_tokens():
    assert VOCAB[0] == 3 and VOCAB[-1] == 950 and len(VOCAB) == 948
    with pytest.raises(ValueError):
        bench.allowed_token_ids(2, [0, 1])


def test_many_short_prompts_are_deterministic_and_in_range():
    cfg = bench.BenchConfig()
    first = bench.many_short_prompts(cfg, VOCAB)
    assert first == bench.many_short_prompts(cfg, VOCAB)
    assert len(first) == 64
    assert all(64 <= len(p) <= 512 for p in first)
    assert all(t in set(VOCAB) for p in first for t in p)
    other = bench.many_short_prompts(bench.BenchConfig(seed=1), VOCAB)
    assert other != first


def test_prompts_do_not_depend_on_global_random_state():
    cfg = bench.BenchConfig()
    random.seed(123)
    a = bench.many_short_prompts(cfg, VOCAB)
    random.seed(456)
    assert bench.many_short_prompts(cfg, VOCAB) == a


def test_one_long_prompt_has_exact_length_and_is_stable():
    for n in (1, 249, 2044):
        prompt = bench.one_long_prompt(0, VOCAB, n)
        assert len(prompt) == n
        assert prompt == bench.one_long_prompt(0, VOCAB, n)


def test_multi_turn_pieces():
    cfg = bench.BenchConfig()
    system = bench.multi_turn_system(cfg, VOCAB)
    assert len(system) == 1200
    assert system == bench.multi_turn_system(cfg, VOCAB)
    a = bench.multi_turn_user(cfg, VOCAB, 0, 0)
    assert len(a) == 100
    assert a == bench.multi_turn_user(cfg, VOCAB, 0, 0)
    assert a != bench.multi_turn_user(cfg, VOCAB, 1, 0)
    assert a != bench.multi_turn_user(cfg, VOCAB, 0, 1)


def test_same_tokens_prompts_share_a_prefix_and_include_long_ones():
    prompts = bench.same_tokens_prompts(0, VOCAB)
    assert prompts == bench.same_tokens_prompts(0, VOCAB)
    assert len(prompts) == 8
    assert sum(len(p) > 600 for p in prompts) >= 3
    prefix = prompts[0][: bench.SAME_TOKENS_PREFIX]
    assert sum(p[: bench.SAME_TOKENS_PREFIX] == prefix for p in prompts) == 3
    # the first three are long and end just before a multiple of 768
    assert all(len(p) % 768 == 760 for p in prompts[:3])


def test_preempt_budget_defaults_per_model_and_override():
    cfg = bench.BenchConfig()
    assert bench.preempt_budget_bytes(cfg, "qwen3_5") == 20 * 2**20
    assert bench.preempt_budget_bytes(cfg, "qwen3_next") == 12 * 2**20
    assert bench.preempt_budget_bytes(cfg, "dense") == 16 * 2**20
    fixed = bench.BenchConfig(preempt_budget_bytes=3 * 2**20)
    assert bench.preempt_budget_bytes(fixed, "qwen3_5") == 3 * 2**20
    args = bench.build_parser().parse_args(["--preempt-budget-mib", "3"])
    assert bench.config_from_args(args).preempt_budget_bytes == 3 * 2**20


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
    geometry = bench.kv_geometry(_qwen3_5_like_config())
    # 2 layers x 2 KV heads x (K 256 + V 256) x 2 bytes
    assert geometry.attn_bytes_per_token == 2 * 2 * 512 * 2 == 4096
    # per GDN layer: conv 3x1024 bf16 + ssm 4x128x128 fp32, not the 524288 pad
    per_layer = 3 * 1024 * 2 + 4 * 128 * 128 * 4
    assert geometry.state_bytes_per_request == 6 * per_layer == 1_609_728
    assert (geometry.num_attention_layers, geometry.num_state_layers) == (2, 6)
    assert geometry.other_layers == ()


def test_geometry_does_not_depend_on_block_size_or_padding():
    a = bench.kv_geometry(_qwen3_5_like_config(256, 524288))
    b = bench.kv_geometry(_qwen3_5_like_config(16, None))
    assert a.attn_bytes_per_token == b.attn_bytes_per_token
    assert a.state_bytes_per_request == b.state_bytes_per_request


def test_bytes_needed_and_token_bound():
    geometry = bench.kv_geometry(_qwen3_5_like_config())
    assert geometry.bytes_needed([]) == 0
    assert geometry.bytes_needed([100, 300]) == 400 * 4096 + 2 * 1_609_728
    # (5 MiB - one state) / bytes per token, rounded down
    assert geometry.token_bound(5 * 2**20) == (5 * 2**20 - 1_609_728) // 4096 == 887
    assert geometry.token_bound(1_000_000) == 0


def test_shared_pool_block_bytes_from_aliasing_tensors():
    config = _qwen3_5_like_config()
    assert bench.shared_pool_block_bytes(config) == 2**20


# ---------------------------------------------------------------------------
# pool adapter
# ---------------------------------------------------------------------------


class _FakePool:
    def __init__(self, num_gpu_blocks: int, free: int, **attrs):
        self.num_gpu_blocks = num_gpu_blocks
        self._free = free
        self.__dict__.update(attrs)

    def get_num_free_blocks(self) -> int:
        return self._free


def test_kv_pools_upstream_single_pool_excludes_null_block():
    pool = _FakePool(48, 40)
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(
            block_pool=pool, coordinator=SimpleNamespace()
        ),
        kv_cache_config=_qwen3_5_like_config(),
    )
    (view,) = bench.kv_pools(scheduler)
    assert view == bench.PoolView("shared", 2**20, 47, 40)
    assert view.used == 7 and view.reserved_bytes == 7 * 2**20
    assert bench.kv_layout_name([view]) == "single"


def test_kv_pools_pooled_mode_reads_owned_blocks_and_block_bytes():
    token = _FakePool(100, 10, owned_ids=range(2, 62), block_bytes=4096)
    state = _FakePool(20, 3, owned_blocks=8, block_bytes=1_609_728)
    coordinator = SimpleNamespace(pools={"token": token, "state": state})
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(block_pool=token, coordinator=coordinator)
    )
    views = bench.kv_pools(scheduler)
    assert views == [
        bench.PoolView("token", 4096, 60, 10),
        bench.PoolView("state", 1_609_728, 8, 3),
    ]
    assert sum(v.reserved_bytes for v in views) == 50 * 4096 + 5 * 1_609_728
    assert bench.kv_layout_name(views) == "pooled"


def test_kv_pools_pooled_block_bytes_fallback_to_config():
    token = _FakePool(10, 5, owned_capacity=9)
    config = SimpleNamespace(pools=[SimpleNamespace(kind="token", block_bytes=512)])
    coordinator = SimpleNamespace(pools={"token": token}, kv_cache_config=config)
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(block_pool=token, coordinator=coordinator)
    )
    assert bench.kv_pools(scheduler) == [bench.PoolView("token", 512, 9, 5)]


# ---------------------------------------------------------------------------
# search and formatting
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 249, 633, 2553, 3000])
def test_longest_completing_finds_the_limit(limit):
    best, probed = bench.longest_completing(lambda n: n <= limit, 1, 3000)
    assert best == limit
    assert len(probed) <= 12


def test_ratio_rules():
    assert bench.ratio(18, 11) == pytest.approx(18 / 11)
    assert bench.ratio(5, 0) is None
    assert bench.ratio("pooled", "single") is None
    assert bench.ratio(True, False) is None
    assert bench.ratio(None, 3) is None


def test_format_value():
    assert bench.format_value(None) == "-"
    assert bench.format_value(True) == "yes"
    assert bench.format_value(2553) == "2,553"
    assert bench.format_value(0.5812) == "0.581"
    assert bench.format_value(12.345) == "12.35"
    assert bench.format_value(123.45) == "123.5"
    assert bench.format_value(35410.2) == "35,410"
    assert bench.format_value("x" * 60).endswith("...")


def test_format_table_aligns_and_shows_ratios():
    rows = [
        bench.Row("qwen3_5", "many_short", "peak running requests", 11, 22),
        bench.Row("qwen3_5", "engine main", "kv layout", "single", "pooled"),
    ]
    text = bench.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == [
        "model",
        "workload",
        "metric",
        "upstream",
        "overlay",
        "overlay/upstream",
    ]
    assert lines[2].endswith("2.00x")
    assert lines[3].endswith("-")
    assert len({len(line) for line in lines[:3]}) == 1


def test_tokens_verdict_and_result_parsing():
    assert bench.tokens_verdict([[1, 2], [3]], [[1, 2], [4]]) == "1/2 prompts equal"
    assert bench.tokens_verdict([[1]], []) == "0/1 prompts equal"
    text = 'log line\nBENCH_RESULT {"a": 1}\nBENCH_RESULT {"a": 2}\n'
    assert bench.parse_result(text) == {"a": 2}
    assert bench.parse_result("nothing") is None


def test_worker_env_sets_the_switch_and_in_process_engines():
    env = bench.worker_env("upstream")
    assert env["VLLM_HYBRID_KV"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert bench.worker_env("overlay")["VLLM_HYBRID_KV"] == "1"


def test_quick_config_and_cli_round_trip():
    args = bench.build_parser().parse_args(["--quick", "--models", "qwen3_5"])
    cfg = bench.config_from_args(args)
    assert cfg.many_short_requests == 8 and cfg.enforce_eager
    assert args.models == ["qwen3_5"]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--workloads", "nope"])


def test_host_independent_state_dtype_and_cached_only_options():
    parse = bench.build_parser().parse_args
    cfg = bench.config_from_args(parse([]))
    assert (cfg.mamba_ssm_cache_dtype, cfg.same_tokens_uncached) == ("float32", True)
    spec = bench._engine_specs("m", "qwen3_5", cfg)["main"]
    assert spec.llm_kwargs()["mamba_ssm_cache_dtype"] == "float32"
    cfg = bench.config_from_args(
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
    assert bench.first_difference_gap(run, other) == "0.2500"
    other = [[1, 9, 3], [4, 5, 0], [7, 8]]  # the largest gap over prompts
    assert bench.first_difference_gap(run, other) == "0.7000"
    assert bench.first_difference_gap(run, run["tokens"]) == "-"


def test_worker_env_pins_threads_only_when_asked(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = bench.worker_env("overlay")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default
    assert "OMP_NUM_THREADS" not in default
    one = bench.worker_env("upstream", 1)
    assert (one["OMP_NUM_THREADS"], one["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "0")
    two = bench.worker_env("upstream", 2)
    assert (two["OMP_NUM_THREADS"], two["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "0-1")
    moved = bench.worker_env("upstream", 2, first_core=4)
    assert moved["VLLM_CPU_OMP_THREADS_BIND"] == "4-5"
    assert bench.worker_env("upstream", 1, first_core=1)[
        "VLLM_CPU_OMP_THREADS_BIND"
    ] == ("1")


def test_concurrent_pinned_workers_get_separate_cores(monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 4)
    slots = bench.CoreSlots(2)
    with slots.first_core(1) as a, slots.first_core(1) as b:
        assert sorted([a, b]) == [0, 1]
    with slots.first_core(2) as a, slots.first_core(2) as b:
        assert sorted([a, b]) == [0, 2]
    # a slot is given back when its worker ends
    for _ in range(3):
        with slots.first_core(1) as a:
            assert a in (0, 1)
    # more cores asked for than the machine has: wrap around
    with bench.CoreSlots(3).first_core(3) as a:
        assert a == 0


def test_same_tokens_gets_its_own_single_thread_workers():
    cfg = bench.BenchConfig()
    jobs = bench.worker_jobs(["m"], ["many_short", "same_tokens"], cfg)
    assert [(j.mode, j.workloads, j.threads) for j in jobs] == [
        ("upstream", ("many_short",), 0),
        ("upstream", ("same_tokens",), 1),
        ("overlay", ("many_short",), 0),
        ("overlay", ("same_tokens",), 1),
    ]
    assert jobs[1].name == "m-upstream-same_tokens" and jobs[0].name == "m-upstream"
    # only same_tokens: no empty main worker
    only = bench.worker_jobs(["m"], ["same_tokens"], cfg)
    assert [j.threads for j in only] == [1, 1]
    # threads 0: everything in the main workers, as before
    shared = bench.worker_jobs(
        ["m"], ["many_short", "same_tokens"], bench.replace(cfg, same_tokens_threads=0)
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
        return bench.WorkerRun("m", mode, rc, 2.0, f"{mode}.log", report)

    main = run("overlay", {"many_short": {"x": 1}}, {"main": {"start_s": 1}})
    same = run(
        "overlay",
        {"same_tokens": {"y": 2}},
        {"main": {"start_s": 9}, "no_pc": {"start_s": 3}},
        errors=["boom"],
        rc=1,
    )
    merged = bench.merge_runs([main, same])
    (key,) = merged
    out = merged[key]
    assert key == ("m", "overlay")
    assert set(out.report["workloads"]) == {"many_short", "same_tokens"}
    # the main worker's description of an engine both opened wins
    assert out.report["engines"] == {"main": {"start_s": 1}, "no_pc": {"start_s": 3}}
    assert out.report["geometry"] == {"g": 1}
    assert out.report["errors"] == ["boom"]
    assert (out.returncode, out.wall_s) == (1, 4.0)
    assert bench.merge_runs([main])[key] is main


def test_same_tokens_threads_option_is_checked():
    parse = bench.build_parser().parse_args
    assert bench.config_from_args(parse([])).same_tokens_threads == 1
    assert (
        bench.config_from_args(
            parse(["--same-tokens-threads", "0"])
        ).same_tokens_threads
        == 0
    )
    with pytest.raises(SystemExit, match="--same-tokens-threads"):
        bench.config_from_args(parse(["--same-tokens-threads", "-1"]))
    with pytest.raises(SystemExit, match="--same-tokens-threads"):
        bench.config_from_args(parse(["--same-tokens-threads", "4096"]))
