"""CUDA smoke test for users' GPU runners (skipped here: no CUDA device)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_overlay_active_and_tiny_hybrid_generates_on_cuda(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_hybrid import plugin

    llm = LLM(
        model=str(tiny_model_dir("qwen3_5")),
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=2048,
        enforce_eager=True,
    )
    assert plugin.state().active
    out = llm.generate(
        ["The hybrid model"],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 8
