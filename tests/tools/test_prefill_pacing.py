"""Prefill pacing on a real scheduler: the first step of a pooled engine
(the tiny qwen3_6 on the simulator's stand-in executor, no model compute)
computes at most a multiple of the state page while few requests wait.

The tiny qwen3_6 has the flagship's per-layer shapes: one GDN layer's state
weighs 1,048 tokens of one bf16 attention layer's KV. Rounded up to the
state block, 128 tokens on the CPU platform, the page is 9 x 128 = 1,152
tokens, and a 4,096-token step budget is paced to 3 x 1,152 = 3,456.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hybrid import envs
from vllm_hybrid.v1.core.pooled.eviction import PACING_MAX_WAITING

BUDGET = 4096
PAGE = 1152


def _first_step_tokens(model: Path, prompts: int, monkeypatch, pacing: str) -> int:
    from vllm_hybrid.tools.plan.geometry import EngineOptions
    from vllm_hybrid.tools.plan.request import PlanRequest
    from vllm_hybrid.tools.simulate.drive import _add
    from vllm_hybrid.tools.simulate.engine import open_engine
    from vllm_hybrid.tools.simulate.sources import SimRequest

    monkeypatch.setenv(envs.PREFILL_PACING_VAR, pacing)
    request = PlanRequest(
        model=str(model),
        kv_cache_memory=256 * 2**20,
        device="cpu",
        mamba_ssm_cache_dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=BUDGET,
        max_model_len=8192,
    )
    with open_engine(request, model, EngineOptions()) as engine:
        scheduler = engine.scheduler
        assert type(scheduler).__name__ == "PooledScheduler"
        for i in range(prompts):
            prompt = [(7 * i + j) % 1000 + 1 for j in range(5000)]
            _add(engine.core, SimRequest(f"r{i}", prompt, 4, 0.0))
        assert len(scheduler.waiting) == prompts
        return scheduler.schedule().total_num_scheduled_tokens


@pytest.mark.parametrize(
    ("pacing", "prompts", "tokens"),
    [
        ("state_page", PACING_MAX_WAITING, 3 * PAGE),
        # more waiting: queueing dominates, the step fills the budget
        ("state_page", PACING_MAX_WAITING + 1, BUDGET),
        ("fill", PACING_MAX_WAITING, BUDGET),
    ],
)
def test_a_paced_step_computes_a_multiple_of_the_state_page(
    tiny_model_dir, monkeypatch, pacing, prompts, tokens
):
    model = tiny_model_dir("qwen3_6")
    assert _first_step_tokens(model, prompts, monkeypatch, pacing) == tokens
