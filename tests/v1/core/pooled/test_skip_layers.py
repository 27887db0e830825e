"""Per-layer KV dtypes in pooled mode: quantized layers next to skip layers.

``--kv-cache-dtype-skip-layers 3`` keeps attention layer 3 of the tiny
``qwen3_next`` at bf16 next to layer 7 in the quantized KV dtype. Pooled mode
puts both layers' natural pages side by side in one token block (one block
id, two page sizes). References with the same flags: for ``fp8`` upstream
vLLM itself (overlay off; vLLM's CPU attention stores fp8); for
``turboquant_k8v4`` the single shared pool with the overlay (upstream's
planning), since vLLM 0.32 has no TurboQuant attention on CPU and the
project's CPU TurboQuant backend serves layer 7.
"""

from __future__ import annotations

import random

import pytest
from engine_utils import generate_greedy, near_tie_differences, scheduler, with_engine
from pooled_invariants import check_invariants

pytestmark = pytest.mark.slow

MiB = 2**20
#: bf16 page of 128 tokens x 2 KV heads x 128 x (K, V); the quantized layer's
#: page of the same 128 tokens (fp8: 1 B per value; TurboQuant k8v4: one
#: 196-byte slot per token and head) and its backend.
BF16_PAGE = 131_072
QUANTIZED = {
    "fp8": (65_536, "CPU_ATTN"),
    "turboquant_k8v4": (50_176, "CPU_TURBOQUANT"),
}


def _prompts() -> list[dict]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 900) for _ in range(300)]
    return [
        {"prompt_token_ids": shared + [rng.randrange(3, 900) for _ in range(n)]}
        for n in (40, 170, 300, 420)
    ]


def _run(llm, pooled: bool) -> dict:
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    out = {
        "backends": {
            name: (layer.attn_backend.get_name(), layer.kv_cache_dtype)
            for name, layer in ctx.items()
            if hasattr(layer, "attn_backend") and name.endswith("self_attn.attn")
        },
        "first": generate_greedy(llm, _prompts(), 16),
        "again": generate_greedy(llm, _prompts(), 16),
    }
    sched = scheduler(llm)
    out["config"] = sched.kv_cache_config
    if pooled:
        coordinator = sched.kv_cache_manager.coordinator
        check_invariants(coordinator.arena)
        llm.reset_prefix_cache()
        out["used_after"] = {
            pool.side.value: pool.get_num_used_blocks()
            for pool in (coordinator.arena.token_pool, coordinator.arena.state_pool)
        }
    return out


@pytest.fixture(scope="module", params=sorted(QUANTIZED))
def runs(request, tiny_model_dir):
    model = str(tiny_model_dir("qwen3_next"))
    flags = dict(
        kv_cache_dtype=request.param,
        kv_cache_dtype_skip_layers=["3"],
        # upstream's single pool needs 0.08 GiB for one 2,048-token request
        kv_cache_memory_bytes=128 * MiB,
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    if request.param == "fp8":
        reference = with_engine(model, False, flags, lambda llm: _run(llm, False))
    else:
        single = {"additional_config": {"hybrid_kv": {"pooled": False}}}
        reference = with_engine(
            model, True, flags | single, lambda llm: _run(llm, False)
        )
    pooled = with_engine(model, True, flags, lambda llm: _run(llm, True))
    return {"dtype": request.param, "reference": reference, "pooled": pooled}


def test_both_dtypes_run_side_by_side_in_one_token_block(runs):
    pooled, dtype = runs["pooled"], runs["dtype"]
    page, backend = QUANTIZED[dtype]
    assert pooled["backends"] == {
        "model.layers.3.self_attn.attn": ("CPU_ATTN", "auto"),
        "model.layers.7.self_attn.attn": (backend, dtype),
    }
    config = pooled["config"]
    token = config.pool_by_kind("token")
    assert token.block_bytes == BF16_PAGE + page
    token_tensors = sorted(
        (t.offset, t.layers, t.layer_stride)
        for t in config.kv_cache_tensors
        if t.block_stride == token.block_bytes
    )
    assert token_tensors == [
        (0, ["model.layers.3.self_attn.attn"], BF16_PAGE),
        (BF16_PAGE, ["model.layers.7.self_attn.attn"], page),
    ]
    assert token.num_blocks == 128 * MiB // (BF16_PAGE + page)


def test_tokens_equal_the_reference_with_the_same_flags(runs):
    reference, pooled = runs["reference"], runs["pooled"]
    assert reference["backends"] == pooled["backends"]
    assert all(len(t) == 16 for t in pooled["first"].tokens)
    # the same tokens, or a difference that starts where the reference's top
    # two tokens were within bf16 rounding (block sizes differ between the
    # layouts, and so does the order the attention kernels add up a row in)
    for run in ("first", "again"):
        assert near_tie_differences(reference["first"], pooled[run].tokens) == []
        assert near_tie_differences(reference["first"], reference[run].tokens) == []


def test_prefix_hits_and_an_empty_arena_afterwards(runs):
    pooled = runs["pooled"]
    # the second pass hits its own first pass at every 128-token edge the
    # prompts reached (3 to 5 blocks each)
    assert pooled["again"].cached == [256, 384, 512, 640]
    assert pooled["used_after"] == {"token": 0, "state": 0}
