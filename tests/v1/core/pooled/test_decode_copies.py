"""A decode step copies a recurrent state only where a checkpoint keeps it.

In align mode a request's state moves to a fresh block at each state block
edge it crosses, so that the block it leaves holds the state at the edge.
Pooled mode's state block is the attention block (16 tokens on a GPU, 32
here, the CPU attention backend's least): copying at every decode edge moved
the whole state (61 MiB for Qwen3.6-35B-A3B) every block of output, to keep a
checkpoint the next edge superseded. A decode edge
that no policy keeps is now crossed in place; only the prompt's edges and
the turn end (the last edge the reply's token budget reaches) are copied.

These tests run a real CPU engine and record every copy the V1 runner makes
(``collect_mamba_copy_meta``, the function ``preprocess_mamba`` calls), by the
edge whose state it keeps; a copy of a block onto itself moves nothing and is
not one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import pytest
from engine_utils import generate_greedy, scheduler, with_engine
from pooled_invariants import check_invariants

pytestmark = pytest.mark.slow

MiB = 2**20
BLOCK = 32
PROMPT = 200
ANSWER = 300
#: the last edge the reply's budget reaches: all tokens but the last sampled
BUDGET_END = (PROMPT + ANSWER - 1) // BLOCK * BLOCK


@contextlib.contextmanager
def moving_copies() -> Iterator[list[int]]:
    """Edges (tokens) whose state each moving copy of the runner keeps: the
    column a copy leaves ends on that edge."""
    from vllm.v1.worker import mamba_utils

    from vllm_hybrid.v1.worker.mamba_copies import is_self_copy

    edges: list[int] = []
    inner = mamba_utils.collect_mamba_copy_meta

    def recording(bufs, config, funcs, group_ids, src, dst, bias, req_state, *rest):
        if src != dst and not is_self_copy(
            req_state.block_ids, group_ids, src, dst, bias
        ):
            edges.append((src + 1) * BLOCK)
        return inner(bufs, config, funcs, group_ids, src, dst, bias, req_state, *rest)

    mamba_utils.collect_mamba_copy_meta = recording
    try:
        yield edges
    finally:
        mamba_utils.collect_mamba_copy_meta = inner


def _two_turns(llm: Any) -> dict:
    rng = random.Random(11)
    first = [rng.randrange(10, 900) for _ in range(PROMPT)]
    with moving_copies() as edges:
        turn1 = generate_greedy(llm, [{"prompt_token_ids": first}], ANSWER)
    follow_up = first + turn1.tokens[0] + [rng.randrange(10, 900) for _ in range(40)]
    turn2 = generate_greedy(llm, [{"prompt_token_ids": follow_up}], 4)
    coordinator = scheduler(llm).kv_cache_manager.coordinator
    check_invariants(coordinator.arena)
    return {
        "edges": list(edges),
        "hit": turn2.cached[0],
        "tokens": turn1.tokens[0] + turn2.tokens[0],
        "in_place": coordinator.short_memory_counts["edges_in_place"],
    }


def _kwargs(pooled: bool) -> dict:
    return dict(
        block_size=BLOCK,
        kv_cache_memory_bytes=48 * MiB,
        max_model_len=1024,
        enable_prefix_caching=True,
        seed=0,
        additional_config={"hybrid_kv": {"pooled": pooled}},
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    model = str(tiny_model_dir("qwen3_next"))
    return {
        "pooled": with_engine(model, True, _kwargs(True), _two_turns),
        "upstream": with_engine(
            model, False, _kwargs(False), lambda llm: generate_tokens(llm)
        ),
    }


def generate_tokens(llm: Any) -> dict:
    rng = random.Random(11)
    first = [rng.randrange(10, 900) for _ in range(PROMPT)]
    turn1 = generate_greedy(llm, [{"prompt_token_ids": first}], ANSWER)
    follow_up = first + turn1.tokens[0] + [rng.randrange(10, 900) for _ in range(40)]
    turn2 = generate_greedy(llm, [{"prompt_token_ids": follow_up}], 4)
    return {"tokens": turn1.tokens[0] + turn2.tokens[0]}


def test_decode_copies_only_the_state_a_checkpoint_keeps(runs):
    edges = runs["pooled"]["edges"]
    decode = [edge for edge in edges if edge > PROMPT]
    # the prompt's own checkpoint, then nothing but the turn end
    assert decode == [BUDGET_END], edges
    # every other decode edge (8 of them) was crossed in place
    crossed = (PROMPT + ANSWER - 2) // BLOCK - PROMPT // BLOCK
    assert runs["pooled"]["in_place"] == crossed - 1


def test_the_follow_up_resumes_from_the_turn_end(runs):
    assert runs["pooled"]["hit"] == BUDGET_END


def test_tokens_equal_upstream(runs):
    assert runs["pooled"]["tokens"] == runs["upstream"]["tokens"]
