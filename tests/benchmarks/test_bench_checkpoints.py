"""State checkpoint counters and the chat_server / two_turn workloads of the
pooled benchmark.

The fast tests check the counting wrappers on real upstream objects (a
``KVCacheManager`` with align-mode GDN groups over one ``BlockPool``), the
state copies read from scheduler outputs, and the chat_server arrival order. The
slow test runs the benchmark's two_turn and a small chat_server, upstream and
pooled mode, at 32-token blocks and checks the counts a trace predicts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from benchmarks.pooled import checkpoints, cli, config


def _align_manager():
    """Upstream's KV cache manager for a qwen3_5-shaped plan (3 GDN groups,
    1 attention group, 256-token blocks), align mode, prefix caching on."""
    from test_bench_pooled import _qwen3_5_like_config
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    plan = _qwen3_5_like_config()
    for group in plan.kv_cache_groups[:3]:
        group.kv_cache_spec = replace(group.kv_cache_spec, mamba_cache_mode="align")
    return KVCacheManager(
        plan,
        max_model_len=4096,
        scheduler_block_size=256,
        hash_block_size=256,
        enable_caching=True,
    )


def _output(new=(), cached=(), scheduled=None):
    """A ``SchedulerOutput`` with what the step observer reads: ``new`` and
    ``cached`` are (request id, computed tokens); a new request's prompt
    ends with its chunk, and it holds one block per group."""
    scheduled = scheduled or {}
    return SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=set(),
        kv_cache_block_copies=None,
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r,
                num_computed_tokens=c,
                prompt_token_ids=[0] * (c + scheduled[r]),
                block_ids=([7], [8], [9], [10]),
            )
            for r, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            num_computed_tokens=[c for _, c in cached],
            new_block_ids=[None for _ in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled,
    )


def test_counters_count_state_groups_only_in_whole_request_states():
    from vllm.v1.core.kv_cache_utils import BlockHash

    manager = _align_manager()
    scheduler = SimpleNamespace(kv_cache_manager=manager)
    counters = checkpoints.attach(scheduler)
    assert counters.state_groups == 3
    managers = manager.coordinator.single_type_managers
    assert getattr(managers[0].allocate_new_blocks, checkpoints._WRAPPED)
    for state in managers[:3]:
        (block,) = state.allocate_new_blocks("r", 256, 256)
        assert block.ref_cnt == 1
    managers[3].allocate_new_blocks("r", 256, 256)  # attention: not counted
    pool = manager.block_pool
    first = managers[0].req_to_blocks["r"][0]
    request = SimpleNamespace(request_id="r", block_hashes=[BlockHash(b"h1")])
    for gid in (0, 1, 2, 3):
        blocks = managers[gid].req_to_blocks["r"]
        pool.cache_full_blocks(request, blocks, 0, 1, 256, gid)
        pool.cache_full_blocks(request, blocks, 1, 1, 256, gid)  # nothing new
    # wrappers are installed once: a second attach counts nothing twice
    checkpoints.attach(scheduler)
    managers[0].allocate_new_blocks("r", 512, 512)
    snap = counters.snapshot()
    assert snap["state_blocks_allocated"] == 4 / 3
    assert snap["checkpoints_cached"] == 1.0
    assert snap["checkpoints_hit"] == 0.0
    assert counters.cached_positions == [("r", 256)]
    assert first.block_hash is not None
    counters.reset()
    assert counters.snapshot()["state_blocks_allocated"] == 0.0
    assert counters.snapshot()["state_copies"] == 0


def test_counters_record_state_hits_by_distinct_checkpoint():
    manager = _align_manager()
    scheduler = SimpleNamespace(kv_cache_manager=manager)
    counters = checkpoints.attach(scheduler)
    managers = manager.coordinator.single_type_managers
    from vllm.v1.core.kv_cache_utils import BlockHash

    request = SimpleNamespace(request_id="a", block_hashes=[BlockHash(b"p")])
    for gid in (0, 1, 2):
        blocks = managers[gid].allocate_new_blocks("a", 256, 256)
        manager.block_pool.cache_full_blocks(request, blocks, 0, 1, 256, gid)
    for req in ("b", "c"):
        for gid in (0, 1, 2):
            hit = managers[gid].req_to_blocks["a"][0]
            managers[gid].add_local_computed_blocks(req, [hit], 256, 0)
    snap = counters.snapshot()
    assert snap["state_hit_events"] == 2.0
    assert snap["checkpoints_hit"] == 1.0
    assert [p for _, p in counters.hit_positions] == [256, 256]
    assert checkpoints.per_unit(snap, requests=4, output_tokens=500) == {
        "state_blocks_allocated_per_request": 0.25,
        "state_blocks_allocated_per_1k_decoded": 2.0,
        "state_copies_per_request": 0.0,
        "state_copies_per_1k_decoded": 0.0,
        "checkpoints_cached_per_request": 0.25,
        "checkpoints_cached_per_1k_decoded": 2.0,
        "checkpoints_hit_per_request": 0.25,
        "checkpoints_hit_per_1k_decoded": 2.0,
    }


def test_state_copies_are_read_from_scheduler_outputs():
    """Block 256: a new request copies its hit's checkpoint; a running one
    copies its state when its chunk ends in another block column. The
    counters read the copies and tokens of the simulator's step observer
    since their last reset."""
    from vllm_hybrid.tools.simulate.steps import StepObserver

    steps = StepObserver(256, 0)
    counters = checkpoints.CheckpointCounters(state_groups=3, steps=steps)
    steps.observe(_output([("c", 0), ("d", 0)], (), {"c": 300, "d": 512}))
    counters.reset()
    # a: fresh prefill (no state yet); b: a prefix hit at 256 taken over;
    # c: a decode step inside its block; d: a decode step crossing the edge at
    # 512
    steps.observe(
        _output(
            [("a", 0), ("b", 256)],
            [("c", 300), ("d", 512)],
            {"a": 256, "b": 44, "c": 1, "d": 1},
        )
    )
    snap = counters.snapshot()
    assert snap["state_copies"] == 2
    assert snap["tokens_scheduled"] == 302
    assert snap["prefill_tokens_computed"] == 300


def test_new_workloads_are_opt_in():
    args = cli.build_parser().parse_args([])
    assert args.workloads == list(config.DEFAULT_WORKLOADS)
    assert "chat_server" not in args.workloads
    args = cli.build_parser().parse_args(
        ["--workloads", "chat_server,two_turn", "--chat-server-conversations", "5"]
    )
    cfg = cli.config_from_args(args)
    assert args.workloads == ["chat_server", "two_turn"]
    assert cfg.chat_server_conversations == 5


@pytest.mark.slow
def test_two_turn_and_chat_server_counts(tiny_model_dir, tmp_path):
    """qwen3_5 at --block-size 32: upstream inflates the block to 160 tokens,
    pooled mode keeps 32. Upstream (overlay off) is pinned exactly: turn 1
    (1,300 + 24 tokens) caches one state checkpoint, at the replay boundary
    floor(1299 / 160) * 160 = 1,280, and turn 2 hits there. In both modes the
    counters must agree with the engine: turn 2's cached tokens are the last
    checkpoint turn 1 cached within the shared 1,324 tokens, and a lone
    request without a hit copies its state once per block it takes after the
    first."""
    root = tiny_model_dir("qwen3_5").parent
    out = tmp_path / "bench.json"
    argv = ["--models", "qwen3_5", "--workloads", "two_turn,chat_server"]
    argv += ["--block-size", "32", "--chat-server-conversations", "6"]
    argv += ["--chat-server-turns", "3", "--chat-server-concurrency", "3"]
    argv += ["--model-dir", str(root), "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    runs = {r["mode"]: r["report"]["workloads"] for r in data["runs"]}
    up = runs["upstream"]["two_turn"]["metrics"]
    assert up["state_block"] == 160
    assert (up["turn1_checkpoints"], up["turn2_cached_tokens"]) == ([1280], 1280)
    assert (up["turn1_state_blocks_allocated"], up["turn1_state_copies"]) == (2, 1)
    ov = runs["overlay"]["two_turn"]["metrics"]
    assert ov["state_block"] == 32
    for m in (up, ov):
        reachable = [p for p in m["turn1_checkpoints"] if p <= m["shared_prefix"]]
        assert m["turn2_cached_tokens"] == max(reachable, default=0)
        assert m["turn1_state_copies"] == m["turn1_state_blocks_allocated"] - 1
    for mode in ("upstream", "overlay"):
        chat = runs[mode]["chat_server"]["metrics"]
        assert chat["requests"] == 18 and chat["output_tokens"] == 18 * 32
        assert chat["checkpoints_hit"] <= chat["checkpoints_cached"]
        fresh = chat["state_blocks_allocated"] + chat["state_in_place"]
        assert chat["state_copies"] <= fresh
        assert chat["state_hit_events"] >= chat["checkpoints_hit"] > 0
        if chat["preemptions"] == 0:
            computed = chat["prompt_tokens"] - chat["cached_tokens"]
            assert chat["prefill_tokens_computed"] == computed
