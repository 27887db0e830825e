"""The simulator's multi_turn workload on real CPU engines: align-mode state
counts pinned (slow), and its checkpoint probe on upstream's objects.

``vllm-hybrid simulate --workload multi_turn`` runs this workload and counts
it with this code: the simulator's driver and step observer on the engine
core, its checkpoint probe, its ``summarize``. Here they run on real engines
of the tiny ``qwen3_5`` at ``--block-size 32`` (48 MiB, prefix caching on),
upstream and pooled mode, 6 conversations x 5 turns. Upstream inflates the
state block to 160 tokens, pooled mode keeps 32. Without preemptions every
prompt token not served from the cache is computed once, and each request
decodes all but its last output token. The fast test runs the probe on a
real ``KVCacheManager`` with align-mode GDN groups over one ``BlockPool``.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from engine_utils import engine_core, qwen3_5_like_kv_config, with_engine

ENGINE = {
    "kv_cache_memory_bytes": 48 * 2**20,
    "enable_prefix_caching": True,
    "max_num_seqs": 64,
    "max_model_len": 4096,
    "block_size": 32,
    "seed": 0,
}


def _multi_turn(llm: Any) -> dict[str, Any]:
    """The workload in one drive from a cold cache: the simulator's counted
    figures, the state copies that moved a state and pooled mode's prefill
    chunks cut at a checkpoint (None upstream)."""
    from testing.inproc import llm_vocab
    from vllm_hybrid.tools.simulate.drive import Driver
    from vllm_hybrid.tools.simulate.probes import count_state_checkpoints
    from vllm_hybrid.tools.simulate.session import summarize
    from vllm_hybrid.tools.simulate.sources import MultiTurnShape, MultiTurnWorkload
    from vllm_hybrid.tools.simulate.steps import ExecutedSteps

    core = engine_core(llm)
    llm.reset_prefix_cache()
    probe = count_state_checkpoints(core.scheduler)
    workload = MultiTurnWorkload(MultiTurnShape(), llm_vocab(llm))
    result = Driver(core, workload, ExecutedSteps(core).take, lambda _: 0.001).run()
    assert result.outcome == "finished"
    counted = summarize(result, 0.0, probe.checkpoints)["counted"]
    counted["copies_moved"] = result.steps.copies_moved
    counted["cuts"] = getattr(core.scheduler, "prefill_checkpoint_cuts", None)
    return counted


@pytest.fixture(scope="module")
def counts(tiny_model_dir) -> dict[str, dict[str, Any]]:
    model = str(tiny_model_dir("qwen3_5"))
    return {
        mode: with_engine(model, mode == "pooled", ENGINE, _multi_turn)
        for mode in ("upstream", "pooled")
    }


@pytest.mark.slow
def test_every_token_is_computed_once(counts) -> None:
    for mode, m in counts.items():
        assert (m["requests"], m["output_tokens"]) == (30, 30 * 32), mode
        assert m["preemptions"] == 0, mode
        computed = m["prompt_tokens"] - m["hit_tokens"]
        assert m["prefill_tokens"] == computed, mode
        assert m["decode_tokens"] == 30 * 31, mode


@pytest.mark.slow
def test_state_copies_and_checkpoints_are_pinned(counts) -> None:
    """Upstream's as the benchmark's own removed wrappers counted them: 57
    copies, 25 checkpoints. Pooled mode's 32-token state blocks cross more
    edges and keep a checkpoint at every turn end; edges no checkpoint keeps
    are crossed in place (102 copies and 67 checkpoints when every edge was
    copied), and once turn ends served more hits than prompts' own
    checkpoints, a prompt whose reply keeps a turn end past it keeps no
    checkpoint of its own (92 copies and 63 checkpoints when every prompt
    kept one)."""
    up, pooled = counts["upstream"], counts["pooled"]
    assert (up["copies_moved"], up["checkpoints_cached"]) == (57, 25)
    assert up["prefill_tokens"] == 11400
    assert up["cuts"] is None
    assert (pooled["copies_moved"], pooled["checkpoints_cached"]) == (80, 51)
    assert pooled["prefill_tokens"] == 5320
    assert pooled["cuts"] >= 1


def test_checkpoints_are_counted_in_whole_request_states() -> None:
    """Block 256: one full block cached in every group is one checkpoint
    (three state keys over three state groups; attention is not counted)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import BlockHash

    from vllm_hybrid.tools.simulate.probes import count_state_checkpoints

    plan = qwen3_5_like_kv_config()
    for group in plan.kv_cache_groups[:3]:
        group.kv_cache_spec = replace(group.kv_cache_spec, mamba_cache_mode="align")
    manager = KVCacheManager(
        plan,
        max_model_len=4096,
        scheduler_block_size=256,
        hash_block_size=256,
        enable_caching=True,
    )
    probe = count_state_checkpoints(SimpleNamespace(kv_cache_manager=manager))
    assert probe.checkpoints == 0
    managers = manager.coordinator.single_type_managers
    request = SimpleNamespace(request_id="r", block_hashes=[BlockHash(b"h1")])
    for gid in (0, 1, 2, 3):
        blocks = managers[gid].allocate_new_blocks("r", 256, 256)
        manager.block_pool.cache_full_blocks(request, blocks, 0, 1, 256, gid)
        manager.block_pool.cache_full_blocks(request, blocks, 1, 1, 256, gid)
    assert probe.checkpoints == 1.0
