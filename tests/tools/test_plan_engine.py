"""``vllm-hybrid plan --device cpu`` against the real CPU engine.

The tiny hybrids are started in-process at the same KV budget, once with the
overlay off (upstream vLLM 0.32) and once in pooled mode; the planner's block
size, state padding, block counts and token capacity must equal what each
engine holds after start-up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
            "tensor_sizes": sorted({t.size for t in config.kv_cache_tensors}),
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
    if Path(model, ONE_AND_ONE).exists():
        kwargs["load_format"] = "dummy"
    return with_engine(model, pooled, kwargs, figures)


#: Marker file of the 1 attention + 1 state group variant (random weights).
ONE_AND_ONE = "one-and-one"


def _one_attention_one_state(tiny: Path, out: Path) -> Path:
    """Tiny qwen3_next cut to one GDN and one attention layer: upstream plans
    one attention and one state group (the tiny kinds have three state
    layers per attention layer, hence 1 + 3 groups). The engine runs it with
    random weights (``load_format="dummy"``)."""
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 2
    config["layer_types"] = ["linear_attention", "full_attention"]
    (out / "config.json").write_text(json.dumps(config))
    (out / ONE_AND_ONE).touch()
    return out


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "1+1"])
def measured(request, tiny_model_dir, tmp_path_factory):
    if request.param == "1+1":
        model = str(
            _one_attention_one_state(
                tiny_model_dir("qwen3_next"), tmp_path_factory.mktemp("hybrid") / "m"
            )
        )
    else:
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
        "state_groups": 1 if request.param == "1+1" else 3,
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
    assert pct > 40  # 95% (qwen3_5), 47% (qwen3_next and its 1 + 1 variant)
    assert len(plan.groups) == engine["groups"]
    # one backing buffer for every group's tensor, counted once
    (size,) = engine["tensor_sizes"]
    (pool,) = plan.pools
    assert pool["num_blocks"] * pool["block_bytes"] == size <= BUDGET


@pytest.mark.parametrize("mode", ["upstream", "pooled"])
def test_requests_times_bytes_fit_the_budget(measured, mode):
    plan = measured["plan"]
    figures = getattr(plan, mode)
    for n in plan.prompt_lens:
        at = figures.at_prompt_len[n]
        assert at["max_concurrency"] * at["bytes_per_request"] <= BUDGET


def test_the_group_structures_are_the_two_named(measured):
    kinds = [g["kind"] for g in measured["plan"].upstream.groups]
    assert kinds.count("attention") == 1
    assert kinds.count("state") == measured["state_groups"]


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
