"""``vllm-hybrid plan --device cpu`` against the real CPU engine.

The tiny hybrids are started in-process at the same KV budget, once with the
overlay off (upstream vLLM 0.32) and once in pooled mode; the planner's block
size, state padding, block counts and token capacity must equal what each
engine holds after start-up.
"""

from __future__ import annotations

import pytest
from engine_utils import ENGINE_DEFAULTS, engine_core, with_engine

from vllm_hybrid.tools import plan as planmod

pytestmark = pytest.mark.slow

MiB = 2**20
BUDGET = 48 * MiB
MAX_MODEL_LEN = 2048


def _engine_figures(model: str, pooled: bool) -> dict:
    from vllm.v1.kv_cache_interface import MambaSpec

    def figures(llm) -> dict:
        core = engine_core(llm)
        config = core.scheduler.kv_cache_manager.kv_cache_config
        cache = core.vllm_config.cache_config
        state = next(
            g.kv_cache_spec
            for g in config.kv_cache_groups
            if isinstance(g.kv_cache_spec, MambaSpec)
        )
        out = {
            "block_size": cache.block_size,
            "num_blocks": config.num_blocks,
            "token_capacity": cache.kv_cache_size_tokens,
            "max_concurrency": cache.kv_cache_max_concurrency,
            "state_real": state.real_page_size_bytes,
            "state_page": state.page_size_bytes,
            "groups": len(config.kv_cache_groups),
        }
        if pooled:
            out["pools"] = [(p.kind, p.num_blocks, p.block_bytes) for p in config.pools]
        return out

    kwargs = dict(
        kv_cache_memory_bytes=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        seed=0,
    )
    return with_engine(model, pooled, kwargs, figures)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def measured(request, tiny_model_dir):
    model = str(tiny_model_dir(request.param))
    plan = planmod.build_plan(
        planmod.PlanRequest(
            model=model,
            kv_cache_memory=BUDGET,
            device="cpu",
            max_model_len=MAX_MODEL_LEN,
            # what the engines below use
            mamba_ssm_cache_dtype=ENGINE_DEFAULTS["mamba_ssm_cache_dtype"],
        )
    )
    return {
        "plan": plan,
        "upstream": _engine_figures(model, pooled=False),
        "pooled": _engine_figures(model, pooled=True),
    }


def test_upstream_figures_equal_the_engine(measured):
    plan, engine = measured["plan"].upstream, measured["upstream"]
    assert plan.error is None
    assert engine["block_size"] > 128  # inflated by upstream's alignment
    assert plan.attention_block_size == engine["block_size"]
    assert plan.num_blocks == engine["num_blocks"]
    assert plan.token_capacity == engine["token_capacity"]
    assert plan.max_concurrency == pytest.approx(engine["max_concurrency"])
    assert plan.state_page_bytes == engine["state_real"]
    assert plan.state_page_padded_bytes == engine["state_page"]
    pct = 100 * (engine["state_page"] - engine["state_real"]) / engine["state_real"]
    assert plan.state_padding_pct == pytest.approx(pct)
    assert pct > 40  # 95% (qwen3_5), 47% (qwen3_next)
    assert len(plan.groups) == engine["groups"]


def test_pooled_figures_equal_pooled_mode(measured):
    plan, engine = measured["plan"].pooled, measured["pooled"]
    assert plan.error is None
    assert plan.attention_block_size == engine["block_size"] == 128
    assert plan.state_padding_bytes == 0
    assert engine["state_page"] == engine["state_real"] == plan.state_page_bytes
    assert plan.num_blocks == engine["num_blocks"]
    assert [
        (p["kind"], p["num_blocks"], p["block_bytes"]) for p in plan.pools
    ] == engine["pools"]
    assert plan.token_capacity == engine["token_capacity"]
    assert plan.max_concurrency == pytest.approx(engine["max_concurrency"])
    assert len(plan.groups) == engine["groups"] == 2
