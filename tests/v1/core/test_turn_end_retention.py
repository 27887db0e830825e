"""Turn-end retention on live engines: a follow-up turn hits the whole previous
conversation up to the last state block edge the previous turn reached while
decoding (vllm_hybrid/v1/core/pooled/retention.py), in pooled and single-pool mode;
``hybrid_kv.retain_turn_ends: false`` gives upstream's retention (the previous
prompt's boundary only)."""

from __future__ import annotations

import random

import pytest
from engine_utils import generate_greedy, scheduler, with_engine
from pooled_invariants import check_invariants

pytestmark = pytest.mark.slow

MiB = 2**20
BLOCK = 32
PROMPT = 1300
ANSWER = 300
#: Tokens the first turn computed: its prompt and all but the last answer token.
COMPUTED = PROMPT + ANSWER - 1


def _kwargs(pooled: bool, retain: bool) -> dict:
    return dict(
        block_size=BLOCK,
        kv_cache_memory_bytes=48 * MiB,
        max_model_len=4096,
        enable_prefix_caching=True,
        seed=0,
        additional_config={"hybrid_kv": {"pooled": pooled, "retain_turn_ends": retain}},
    )


def _two_turns(llm) -> dict:
    rng = random.Random(7)
    first = [rng.randrange(10, 900) for _ in range(PROMPT)]
    turn1 = generate_greedy(llm, [{"prompt_token_ids": first}], ANSWER)
    follow_up = first + turn1.tokens[0] + [rng.randrange(10, 900) for _ in range(40)]
    turn2 = generate_greedy(llm, [{"prompt_token_ids": follow_up}], 4)
    coordinator = scheduler(llm).kv_cache_manager.coordinator
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    states = [
        m for m in coordinator.single_type_managers if isinstance(m, MambaManager)
    ]
    state_block = states[0].block_size
    counts = getattr(coordinator, "turn_end_counts", None)
    arena = getattr(coordinator, "arena", None)
    if arena is not None:
        check_invariants(arena)  # links, caches and free lists agree
    return {
        "hit": turn2.cached[0],
        "state_block": state_block,
        "counts": None if counts is None else (counts.cached, counts.superseded),
        "tracked": None if counts is None else len(counts.by_request),
        "coordinator": type(coordinator).__name__,
        "state_groups": len(states),
    }


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    model = str(tiny_model_dir("qwen3_next"))
    return {
        (pooled, retain): with_engine(model, True, _kwargs(pooled, retain), _two_turns)
        for pooled in (True, False)
        for retain in (True, False)
    }


def _edge(tokens: int, block: int) -> int:
    return tokens // block * block


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "single_pool"])
def test_follow_up_hits_the_last_edge_the_answer_reached(runs, pooled):
    run = runs[(pooled, True)]
    block = run["state_block"]
    assert run["hit"] == _edge(COMPUTED, block)
    assert run["hit"] > _edge(PROMPT - 1, block)
    groups = run["state_groups"]
    if pooled:
        # Per state group, one decode checkpoint: the last edge the reply's
        # budget reaches, copied there; every other edge crossed in place
        assert run["counts"] == (groups, 0)
    else:
        # The single pool copies at every edge of its block anyway: one
        # decode checkpoint cached per edge crossed, all but the last
        # evicted again.
        edges = _edge(COMPUTED, block) // block - _edge(PROMPT, block) // block
        assert run["counts"] == (edges * groups, (edges - 1) * groups)
    # nothing is left tracked once requests finished
    assert run["tracked"] == 0


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "single_pool"])
def test_without_turn_ends_the_follow_up_hits_the_prompt_boundary(runs, pooled):
    run = runs[(pooled, False)]
    assert run["hit"] == _edge(PROMPT - 1, run["state_block"])
    if pooled:
        assert run["counts"] == (0, 0)
    else:  # upstream's own coordinator
        assert run["coordinator"] == "HybridKVCacheCoordinator"


def test_block_sizes_are_what_the_hits_were_computed_with(runs):
    assert runs[(True, True)]["state_block"] == BLOCK
    assert runs[(True, True)]["coordinator"] == "PooledHybridKVCacheCoordinator"
    assert runs[(False, True)]["state_block"] > BLOCK
    assert runs[(False, True)]["coordinator"] == "TurnEndHybridKVCacheCoordinator"
