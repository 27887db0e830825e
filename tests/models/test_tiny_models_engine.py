"""Every tiny model kind loads in the CPU engine, with the overlay, and generates."""

from __future__ import annotations

import pytest
from engine_utils import ENGINE_DEFAULTS, full_collect, scheduler

pytestmark = pytest.mark.slow

#: Upstream's CPU Mamba2 kernel fails in align mode, i.e. with prefix caching.
PREFIX_CACHING = {
    "qwen3_next": True,
    "qwen3_5": True,
    "nemotron_h": False,
    "dense": True,
}


@pytest.fixture
def in_process_engine(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("VLLM_HYBRID_KV", raising=False)


@pytest.mark.parametrize("kind", sorted(PREFIX_CACHING))
def test_tiny_model_generates(kind, tiny_model_dir, in_process_engine):
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm_hybrid import plugin

    llm = LLM(
        model=str(tiny_model_dir(kind)),
        kv_cache_memory_bytes=32 * 2**20,
        max_model_len=2048,
        max_num_seqs=4,
        enable_prefix_caching=PREFIX_CACHING[kind],
        **ENGINE_DEFAULTS,
    )
    try:
        assert plugin.state() is not None and plugin.state().active
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = ["The hybrid model", "A longer prompt about memory and state " * 8]
        first = llm.generate(prompts, params)
        again = llm.generate(prompts, params)
        ids = [list(o.outputs[0].token_ids) for o in first]
        assert [len(t) for t in ids] == [12, 12]
        # greedy decoding is deterministic run to run
        assert ids == [list(o.outputs[0].token_ids) for o in again]
        coordinator = scheduler(llm)
        coordinator = coordinator.kv_cache_manager.coordinator
        # hybrid kinds run in pooled mode by default; the dense control never
        assert type(coordinator).__name__.startswith("Pooled") == (kind != "dense")
        vocab = llm.get_tokenizer().vocab_size
        assert all(0 <= t < vocab + 256 for seq in ids for t in seq)
    finally:
        del llm
        full_collect()
        cleanup_dist_env_and_memory()
