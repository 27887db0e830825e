"""Per-pool usage snapshots: arena -> engine-core file -> frontend gauges."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from vllm_hybrid.envs import STATS_DIR_VAR
from vllm_hybrid.v1.core.pooled import usage as core_usage
from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout
from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin
from vllm_hybrid.v1.metrics import pool_snapshots
from vllm_hybrid.v1.metrics.pool_snapshots import (
    PoolStatsPublisher,
    read_snapshot,
    stats_dir,
)


@pytest.fixture
def transport(tmp_path, monkeypatch):
    """The plugin's transport installed for the test, into ``tmp_path``; the
    publisher and directory the process had are put back afterwards."""
    monkeypatch.setenv(STATS_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(core_usage, "_publisher_factory", None)
    pool_snapshots.install()


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
    usage = arena.usage()
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
    assert not publisher.publish(arena.usage())
    assert not directory.exists()
    directory.mkdir()
    assert publisher.publish(arena.usage())
    assert not publisher.publish(arena.usage())  # unchanged
    arena.state_pool.get_new_blocks(1)
    assert publisher.publish(arena.usage())
    read = read_snapshot(str(directory), 3)
    assert read == arena.usage()
    assert read_snapshot(str(directory), 0) is None
    assert os.listdir(directory) == ["engine-3.json"]


class _UpstreamScheduler:
    """The attributes of upstream's Scheduler the pooled mixin uses."""

    def __init__(self, arena: KVArena, log_stats: bool) -> None:
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_index=2)
        )
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[])
        self.cache_config = SimpleNamespace(mamba_cache_mode="align", block_size=16)
        self.max_num_scheduled_tokens = 8192
        self.kv_cache_manager = SimpleNamespace(
            coordinator=SimpleNamespace(arena=arena, single_type_managers=())
        )
        self.connector = None
        self.log_stats = log_stats
        self.stats_calls = 0

    def make_stats(self, *args, **kwargs):
        self.stats_calls += 1
        return {"step": self.stats_calls} if self.log_stats else None


class _Scheduler(PooledSchedulerMixin, _UpstreamScheduler):
    pass


def test_usage_is_published_by_the_stats_step_not_by_usage_reads(tmp_path, transport):
    arena = _arena()
    scheduler = _Scheduler(arena, log_stats=True)
    arena.token_pool.get_new_blocks(2)
    # reading usage (what upstream's scheduler does for its stats) writes nothing
    assert arena.token_pool.get_usage() == 2 / arena.token_capacity
    assert os.listdir(tmp_path) == []
    assert scheduler.make_stats() == {"step": 1}
    assert os.listdir(tmp_path) == ["engine-2.json"]
    assert read_snapshot(str(tmp_path), 2).pools[0].used_blocks == 2
    arena.state_pool.get_new_blocks(1)
    scheduler.make_stats()
    assert read_snapshot(str(tmp_path), 2) == arena.usage()


def test_no_stats_no_snapshot(tmp_path, transport):
    scheduler = _Scheduler(_arena(), log_stats=False)
    assert scheduler.make_stats() is None
    assert os.listdir(tmp_path) == []


def test_stats_dir_is_named_once_per_process_tree():
    env: dict[str, str] = {}
    first = stats_dir(env)
    assert env[STATS_DIR_VAR] == first
    assert str(os.getpid()) in first
    # a child sees the parent's choice
    assert stats_dir({STATS_DIR_VAR: "/x/y"}) == "/x/y"


def test_without_a_transport_the_scheduler_hands_usage_nowhere(tmp_path, monkeypatch):
    """The core writes nothing itself: with no publisher installed (the
    plugin not active in this process) the stats step only computes."""
    monkeypatch.setenv(STATS_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(core_usage, "_publisher_factory", None)
    scheduler = _Scheduler(_arena(), log_stats=True)
    assert scheduler.make_stats() == {"step": 1}
    assert os.listdir(tmp_path) == []


def test_the_core_hands_over_values_to_the_installed_publisher(monkeypatch):
    seen = []
    monkeypatch.setattr(
        core_usage,
        "_publisher_factory",
        lambda index: lambda u: seen.append((index, u)),
    )
    arena = _arena()
    scheduler = _Scheduler(arena, log_stats=True)
    scheduler.make_stats()
    assert seen == [(2, arena.usage())]


def test_the_snapshot_text_round_trips():
    usage = _arena().usage()
    assert pool_snapshots.from_json(pool_snapshots.to_json(usage)) == usage
