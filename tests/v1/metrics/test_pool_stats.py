"""Per-pool usage snapshots: arena -> engine-core file -> frontend gauges."""

from __future__ import annotations

import os

from vllm_hybrid.v1.core.arena import ArenaLayout, KVArena
from vllm_hybrid.v1.metrics.pool_stats import (
    STATS_DIR_VAR,
    PoolStatsPublisher,
    arena_usage,
    read_snapshot,
    stats_dir,
)


def _arena() -> KVArena:
    layout = ArenaLayout(
        arena_bytes=100 * 4096,
        token_block_bytes=4096,
        state_block_bytes=3 * 4096,
        min_token_blocks=1,
        min_state_blocks=1,
        initial_boundary=50 * 4096,
    )
    return KVArena(layout, enable_caching=False, hash_block_size=16)


def test_snapshot_counts_blocks_and_bytes_per_pool():
    arena = _arena()
    arena.token_pool.get_new_blocks(5)
    arena.state_pool.get_new_blocks(2)
    usage = arena_usage(arena)
    token, state = usage.pools
    assert (token.pool, token.used_blocks, token.used_bytes) == ("token", 5, 5 * 4096)
    assert (state.pool, state.used_blocks, state.used_bytes) == ("state", 2, 6 * 4096)
    assert token.owned_blocks == arena.token_capacity
    assert state.owned_blocks == arena.state_capacity
    assert token.usage == 5 / arena.token_capacity
    assert usage.usage == (5 + 6) * 4096 / (100 * 4096)
    assert usage.boundary_bytes == arena.boundary_bytes


def test_publisher_writes_only_for_a_reader_and_only_changes(tmp_path):
    arena = _arena()
    directory = tmp_path / "stats"
    publisher = PoolStatsPublisher(3, str(directory))
    # no frontend created the directory: nothing is written
    assert not publisher.publish(arena_usage(arena))
    assert not directory.exists()
    directory.mkdir()
    assert publisher.publish(arena_usage(arena))
    assert not publisher.publish(arena_usage(arena))  # unchanged
    arena.state_pool.get_new_blocks(1)
    assert publisher.publish(arena_usage(arena))
    read = read_snapshot(str(directory), 3)
    assert read == arena_usage(arena)
    assert read_snapshot(str(directory), 0) is None
    assert os.listdir(directory) == ["engine-3.json"]


def test_token_pool_usage_read_publishes(tmp_path):
    arena = _arena()
    seen = []
    arena.token_pool.on_usage = lambda: seen.append(arena_usage(arena))
    arena.token_pool.get_new_blocks(2)
    assert arena.token_pool.get_usage() == 2 / arena.token_capacity
    assert len(seen) == 1 and seen[0].pools[0].used_blocks == 2


def test_stats_dir_is_named_once_per_process_tree():
    env: dict[str, str] = {}
    first = stats_dir(env)
    assert env[STATS_DIR_VAR] == first
    assert str(os.getpid()) in first
    # a child sees the parent's choice
    assert stats_dir({STATS_DIR_VAR: "/x/y"}) == "/x/y"
