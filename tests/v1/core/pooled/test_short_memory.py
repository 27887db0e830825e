"""Pooled mode, prefix caching on, one long request at a tight budget.

At a state block edge align mode hands a running request a fresh state block
and copies the running state into it, so a request holds two state blocks for
a step. When the arena cannot serve that, the pooled coordinator advances the
state in the block the request owns. The request must then produce exactly
the tokens of a roomy reference engine, also when run again over whatever
stayed in the prefix cache (up to bf16 near-ties: the two engines cut the
prefill into other chunks).
"""

from __future__ import annotations

import random

import pytest
from engine_utils import (
    generate_greedy,
    near_tie_differences,
    record_calls,
    record_preemptions,
    scheduler,
    with_engine,
)
from pooled_invariants import check_invariants

pytestmark = pytest.mark.slow

MiB = 2**20
OUTPUT = 40  # crosses at least one 32-token state block edge while decoding


def _long_prompt(length: int) -> dict:
    rng = random.Random(11)
    return {"prompt_token_ids": [rng.randrange(3, 900) for _ in range(length)]}


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    model = str(tiny_model_dir("qwen3_5"))
    tight = dict(
        kv_cache_memory_bytes=5 * MiB,
        enable_prefix_caching=True,
        block_size=32,
        max_model_len=-1,
        max_num_seqs=1,
    )

    def pooled(llm):
        sched = scheduler(llm)
        coord = sched.kv_cache_manager.coordinator
        max_len = llm.llm_engine.vllm_config.model_config.max_model_len
        prompt = _long_prompt(max_len - OUTPUT)
        preempted = record_preemptions(sched)
        first = generate_greedy(llm, [prompt], OUTPUT).tokens
        counts = dict(coord.short_memory_counts)
        again = generate_greedy(llm, [prompt], OUTPUT).tokens  # may hit the cache
        # a prompt that can never fit (max_model_len is auto-fitted to the
        # budget) is refused at once instead of waiting forever: refused
        # before it reaches the scheduler, so no step ever waits on it
        admitted = record_calls(sched, "add_request")
        try:
            generate_greedy(llm, [_long_prompt(max_len + 1)], OUTPUT)
            refusal = None
        except Exception as exc:  # vLLM raises a ValueError subclass
            refusal = f"{type(exc).__name__}: {exc}"
        llm.reset_prefix_cache()
        free = {
            p.side: (p.get_num_free_blocks(), p.owned_capacity)
            for p in (coord.arena.token_pool, coord.arena.state_pool)
        }
        check_invariants(coord.arena)
        return dict(
            prompt=prompt,
            max_len=max_len,
            first=first,
            again=again,
            counts=counts,
            preempted=len(preempted),
            free=free,
            state_block_bytes=coord.arena.layout.state_block_bytes,
            refusal=refusal,
            refused_requests_scheduled=len(admitted),
        )

    result = with_engine(model, True, tight, pooled)
    roomy = dict(
        kv_cache_memory_bytes=48 * MiB, enable_prefix_caching=False, max_model_len=2048
    )
    result["reference"] = with_engine(
        model,
        False,
        roomy,
        lambda llm: generate_greedy(llm, [result["prompt"]], OUTPUT),
    )
    return result


def test_lone_request_fits_one_state_block(runs):
    # (5 MiB - one request's state) / 4096 B per token = 887 tokens; block
    # rounding and the null block leave 832 for max_model_len -1
    assert runs["max_len"] >= 0.9 * (5 * MiB - runs["state_block_bytes"]) // 4096
    assert runs["preempted"] == 0


def test_short_memory_paths_taken(runs):
    # 792 + 40 tokens cross the 32-token state block edges at 800 and 832
    assert runs["counts"]["state_in_place"] == 2, runs["counts"]


def test_tokens_equal_roomy_reference(runs):
    assert near_tie_differences(runs["reference"], runs["first"]) == []
    assert near_tie_differences(runs["reference"], runs["again"]) == []
    assert len(runs["first"][0]) == OUTPUT


def test_pools_fully_free_after_reset(runs):
    for kind, (free, owned) in runs["free"].items():
        assert free == owned, (kind, free, owned)


def test_request_that_can_never_fit_is_refused_at_once(runs):
    refusal = runs["refusal"]
    assert refusal is not None
    assert "maximum context length" in refusal and str(runs["max_len"]) in refusal
    assert runs["refused_requests_scheduled"] == 0
