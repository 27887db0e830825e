"""Engines start and generate at KV budgets of any byte count.

The arena is the budget rounded down to ``VIEW_ALIGNMENT_BYTES``, so the
state pool starts aligned whether it sits after the null region (null
blocks apart, what CUDA graphs need) or at ``arena % state block`` (null
blocks overlapping, the CPU and eager default). 32 MiB + 1 B used to stop
the tiny ``qwen3_next`` at start-up: ``storage_offset() must be divisible by
2`` when its conv state was viewed as bf16.
"""

from __future__ import annotations

import pytest
from engine_utils import generate_greedy, scheduler, with_engine

from vllm_hybrid.v1.core.pooled import engine as pooled_engine
from vllm_hybrid.v1.core.pooled.spec import VIEW_ALIGNMENT_BYTES

pytestmark = pytest.mark.slow

MiB = 2**20
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 200)]


@pytest.mark.parametrize(
    "budget,overlap",
    [(32 * MiB + 1, True), (32 * MiB + 255, True), (32 * MiB + 3, False)],
)
def test_odd_budget_starts_and_generates(tiny_model_dir, monkeypatch, budget, overlap):
    # CPU engines always overlap null blocks; the other mode is what a CUDA
    # engine with graphs plans, forced here in the in-process engine core.
    monkeypatch.setattr(pooled_engine, "null_blocks_may_overlap", lambda _: overlap)

    def work(llm):
        config = scheduler(llm).kv_cache_config
        out = generate_greedy(llm, PROMPTS, 4)
        return config, out

    config, out = with_engine(
        str(tiny_model_dir("qwen3_next")),
        True,
        dict(kv_cache_memory_bytes=budget, max_model_len=512),
        work,
    )
    assert config.null_blocks_overlap is overlap
    assert config.arena_bytes == budget // VIEW_ALIGNMENT_BYTES * VIEW_ALIGNMENT_BYTES
    for tensor in config.kv_cache_tensors:
        assert tensor.offset % VIEW_ALIGNMENT_BYTES == 0
    assert [len(t) for t in out.tokens] == [4, 4]
