"""State checkpoint counters and the chat_server / two_turn workloads of the
pooled benchmark.

The fast tests check the counting wrappers on real upstream objects (a
``KVCacheManager`` with align-mode GDN groups over one ``BlockPool``, and the
worker's ``collect_mamba_copy_meta``) and the chat_server arrival order. The
slow test runs the benchmark's two_turn and a small chat_server, upstream and
pooled mode, at 32-token blocks and checks the counts a trace predicts.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.pooled import checkpoints, cli, config, prompts


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


def test_counters_count_state_groups_only_in_whole_request_states():
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    manager = _align_manager()
    output = SimpleNamespace(total_num_scheduled_tokens=300)
    scheduler = SimpleNamespace(kv_cache_manager=manager, schedule=lambda: output)
    counters = checkpoints.attach(scheduler)
    assert counters.state_groups == 3
    # wrappers are installed once: a second attach returns the same counters
    assert checkpoints.attach(scheduler) is counters
    managers = manager.coordinator.single_type_managers
    assert getattr(managers[0].allocate_new_blocks, checkpoints._WRAPPED)
    for state in managers[:3]:
        (block,) = state.allocate_new_blocks("r", 256, 256)
        assert block.ref_cnt == 1
    managers[3].allocate_new_blocks("r", 256, 256)  # attention: not counted
    pool = manager.block_pool
    first = managers[0].req_to_blocks["r"][0]
    for gid in (0, 1, 2, 3):
        key = make_block_hash_with_group_id(BlockHash(b"h1"), gid)
        block = managers[gid].req_to_blocks["r"][0]
        pool._insert_block_hash(key, block, num_tokens=256)
        pool._insert_block_hash(key, block, num_tokens=256)  # already there
    scheduler.schedule()
    snap = counters.snapshot()
    assert snap["state_blocks_allocated"] == 1.0
    assert snap["checkpoints_cached"] == 1.0
    assert snap["checkpoints_hit"] == 0.0
    assert snap["tokens_scheduled"] == 300
    assert counters.cached_positions == [("", 256)]
    assert first.block_hash is not None
    counters.reset()
    assert counters.snapshot()["state_blocks_allocated"] == 0.0


def test_counters_record_state_hits_by_distinct_checkpoint():
    manager = _align_manager()
    scheduler = SimpleNamespace(
        kv_cache_manager=manager,
        schedule=lambda: SimpleNamespace(total_num_scheduled_tokens=0),
    )
    counters = checkpoints.attach(scheduler)
    managers = manager.coordinator.single_type_managers
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    for gid in (0, 1, 2):
        (block,) = managers[gid].allocate_new_blocks("a", 256, 256)
        key = make_block_hash_with_group_id(BlockHash(b"p"), gid)
        manager.block_pool._insert_block_hash(key, block, num_tokens=256)
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


def test_copy_probe_counts_worker_copies_and_self_copies():
    from vllm.v1.worker import mamba_utils

    checkpoints.install_copy_probe()
    checkpoints.install_copy_probe()  # idempotent
    probe = mamba_utils.collect_mamba_copy_meta
    assert getattr(probe, checkpoints._WRAPPED)
    before = (checkpoints._TALLY.copies, checkpoints._TALLY.self_copies)
    bufs = SimpleNamespace(
        src_ptrs=SimpleNamespace(np=np.zeros(4)),
        dst_ptrs=SimpleNamespace(np=np.zeros(4)),
        sizes=SimpleNamespace(np=np.zeros(4)),
        offset=0,
    )
    # One state group without layers: upstream's function only does its
    # bookkeeping. Columns 0 and 1 name block 7 (an in-place crossing).
    plan = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[])])
    state = SimpleNamespace(block_ids=[[7, 7, 9]])
    probe(bufs, plan, {}, [0], 1, 1, 0, state, {})  # same column: no copy
    probe(bufs, plan, {}, [0], 0, 2, 0, state, {})  # a copy
    probe(bufs, plan, {}, [0], 0, 1, 0, state, {})  # a copy onto itself
    after = (checkpoints._TALLY.copies, checkpoints._TALLY.self_copies)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)


def test_chat_server_order_interleaves_every_turn_once_in_order():
    cfg = config.BenchConfig()
    order = prompts.chat_server_order(cfg)
    assert order == prompts.chat_server_order(cfg)
    assert len(order) == 32 * 6
    assert Counter(conv for conv, _ in order) == {c: 6 for c in range(32)}
    for conv in range(32):
        assert [t for c, t in order if c == conv] == list(range(6))
    # interleaved: a conversation's turns are not back to back
    assert sum(a[0] == b[0] for a, b in zip(order[:-1], order[1:], strict=True)) < 16
    assert prompts.chat_server_order(replace(cfg, seed=1)) != order
    vocab = prompts.allowed_token_ids(951, [0, 1, 2])
    lengths = {len(prompts.chat_server_user(cfg, vocab, c, t)) for c, t in order}
    assert min(lengths) >= 40 and max(lengths) <= 160 and len(lengths) > 20


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
