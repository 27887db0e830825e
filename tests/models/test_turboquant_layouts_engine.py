"""CPU_TURBOQUANT on head-major pages in a live engine (tiny qwen3_next).

vLLM resolves one KV cache layout per engine. TurboQuant layers alone get
token-major ``LBNHC``; with ``--kv-cache-dtype-skip-layers`` the layers kept
at bf16 run CPU_ATTN, which only takes head-major ``LBHNC``, so the
TurboQuant layer must run on ``LBHNC`` pages too.

A kernel that misplaced slots the same way in store and attention would be
a permutation inside each page and invisible here; tests/ops/
test_tq_page_layouts.py checks where the bytes land.
"""

from __future__ import annotations

import pytest
from engine_utils import with_engine

from vllm_hybrid.v1.attention.backends.cpu_turboquant_attn import (
    CPUTurboQuantAttentionBackend,
)

pytestmark = pytest.mark.slow

MiB = 2**20
PROMPTS = ["hello world " * 50, "the cat sat on"]
MAX_TOKENS = 16


def _serve(model, pooled=False, **kw) -> tuple[str, list[list[int]]]:
    """Resolved layout and greedy tokens of :data:`PROMPTS`."""
    from vllm import SamplingParams

    kwargs = (
        dict(
            kv_cache_dtype="turboquant_k8v4",
            kv_cache_memory_bytes=48 * MiB,
            max_model_len=2048,
            enable_prefix_caching=True,
            additional_config={"hybrid_kv": {"pooled": pooled}},
        )
        | kw
    )

    def work(llm):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        outs = llm.generate(PROMPTS, params)
        layout = llm.llm_engine.vllm_config.cache_config.kv_cache_layout
        return layout, [list(o.outputs[0].token_ids) for o in outs]

    return with_engine(str(model), True, kwargs, work)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3_next")


@pytest.mark.parametrize("pooled", [False, True], ids=["single", "pooled"])
def test_turboquant_alone_gives_the_same_tokens_on_head_major_pages(
    model, pooled, monkeypatch
):
    """Pooled mode puts both attention layers' pages in one token block, so
    there the block stride is two pages in either layout."""
    layout, token_major = _serve(model, pooled)
    assert layout == "LBNHC"
    monkeypatch.setattr(
        CPUTurboQuantAttentionBackend,
        "supported_kv_cache_layouts",
        classmethod(lambda cls: _only("LBHNC")),
    )
    layout, head_major = _serve(model, pooled)
    assert layout == "LBHNC"
    assert head_major == token_major
    assert all(len(t) == MAX_TOKENS for t in token_major)


def test_skip_layer_on_cpu_attn_runs_next_to_turboquant_on_head_major_pages(model):
    """Layer 3 at bf16 on CPU_ATTN, layer 7 TurboQuant. Block size 32: at
    vLLM's CPU default of 128, ``Platform._align_hybrid_block_size`` makes
    every page 128 x lcm(per-token pages) = 6.1 MiB and 48 MiB cannot hold one
    request (docs/turboquant-backend.md); the pages do not change the
    numbers, so a larger cache at block 128 gives the same tokens."""
    skip = {"kv_cache_dtype_skip_layers": ["3"]}
    layout, small_blocks = _serve(model, block_size=32, **skip)
    assert layout == "LBHNC"
    assert all(len(t) == MAX_TOKENS for t in small_blocks)
    layout, default_blocks = _serve(model, kv_cache_memory_bytes=256 * MiB, **skip)
    assert layout == "LBHNC"
    assert default_blocks == small_blocks


def _only(name: str):
    from vllm.v1.kv_cache_interface import KVCacheLayout

    return (KVCacheLayout[name],)
