"""Align-mode state counts of the pooled benchmark's multi_turn workload.

The benchmark counts them with the simulator's code (``vllm-hybrid
simulate`` reports the same figures): state copies and scheduled tokens from
its step observer (tests/tools/test_simulate.py), checkpoints entered into
the prefix cache from its probe. The fast test drives the probe through the
benchmark's ``Engine`` on real upstream objects (a ``KVCacheManager`` with
align-mode GDN groups over one ``BlockPool``); the slow test runs the
benchmark's multi_turn, upstream and pooled mode, and checks the counts
against the engine's own outputs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from benchmarks.pooled import cli, config, engine


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


class _BareEngine(engine.Engine):
    """The benchmark's ``Engine`` over a bare scheduler (no ``vllm.LLM``)."""

    def __init__(self, scheduler, prefix_caching: bool = True):
        kwargs = {"enable_prefix_caching": prefix_caching}
        super().__init__(llm=None, kwargs=kwargs, start_s=0.0)
        self._scheduler = scheduler

    @property
    def scheduler(self):
        return self._scheduler


def test_checkpoints_are_counted_in_whole_request_states():
    """Block 256: one full block cached in every group is one checkpoint
    (three state keys over three state groups; attention is not counted).
    The probe is attached once, and not at all without prefix caching (no
    align-mode state groups)."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    manager = _align_manager()
    bare = _BareEngine(SimpleNamespace(kv_cache_manager=manager))
    probe = bare.count_checkpoints()
    assert bare.count_checkpoints() is probe
    assert probe.checkpoints == 0
    managers = manager.coordinator.single_type_managers
    request = SimpleNamespace(request_id="r", block_hashes=[BlockHash(b"h1")])
    for gid in (0, 1, 2, 3):
        blocks = managers[gid].allocate_new_blocks("r", 256, 256)
        manager.block_pool.cache_full_blocks(request, blocks, 0, 1, 256, gid)
        manager.block_pool.cache_full_blocks(request, blocks, 1, 1, 256, gid)
    assert probe.checkpoints == 1.0
    no_caching = _BareEngine(SimpleNamespace(kv_cache_manager=manager), False)
    assert no_caching.count_checkpoints() is None


def test_workloads_are_the_three_default_ones():
    """chat_server and two_turn left the benchmark: ``vllm-hybrid simulate
    --workload chat_server`` counts the first with the same scheduler and
    workload, tests/v1/core/test_turn_end_retention.py checks where a
    follow-up turn hits. same_tokens left it for the engine test
    tests/v1/core/pooled/test_same_tokens.py."""
    args = cli.build_parser().parse_args([])
    assert args.workloads == list(config.WORKLOADS)
    assert config.WORKLOADS == ("many_short", "one_long", "multi_turn")
    for gone in ("chat_server", "two_turn", "same_tokens"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--workloads", gone])


@pytest.mark.slow
def test_multi_turn_state_counts_agree_with_the_engine(tiny_model_dir, tmp_path):
    """qwen3_5 at --block-size 32, multi_turn's 6 conversations x 5 turns:
    upstream inflates the state block to 160 tokens, pooled mode keeps 32.
    Without preemptions every prompt token not served from the cache is
    computed once, and each request decodes all but its last output token.
    Both modes' counts are pinned (upstream's as the benchmark's own removed
    wrappers counted them: 57 copies, 25 checkpoints)."""
    root = tiny_model_dir("qwen3_5").parent
    out = tmp_path / "bench.json"
    argv = ["--models", "qwen3_5", "--workloads", "multi_turn", "--block-size", "32"]
    argv += ["--model-dir", str(root), "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    runs = {r["mode"]: r["report"]["workloads"]["multi_turn"] for r in data["runs"]}
    for mode, result in runs.items():
        m = result["metrics"]
        assert (m["requests"], m["output_tokens"]) == (30, 30 * 32), mode
        assert m["preemptions"] == 0, mode
        computed = m["prompt_tokens"] - m["hit_tokens"]
        assert m["prefill_tokens"] == computed, mode
        assert m["prefill_tokens"] + m["decode_tokens"] == computed + 30 * 31, mode
    up, pooled = runs["upstream"]["metrics"], runs["overlay"]["metrics"]
    assert (up["state_copies"], up["checkpoints_cached"]) == (57, 25)
    assert up["prefill_tokens"] == 11400
    assert up["prefill_checkpoint_cuts"] is None
    # 32-token state blocks: more edges crossed, a checkpoint at every turn end.
    # Copies that move a state: edges no checkpoint keeps are crossed in place
    # (102 copies and 67 checkpoints when every edge was copied)
    assert (pooled["state_copies"], pooled["checkpoints_cached"]) == (92, 63)
    assert pooled["prefill_checkpoint_cuts"] >= 1
