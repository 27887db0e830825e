"""Token block moves end to end on a CPU engine (slow).

A pooled engine of the tiny Qwen3.5-shaped hybrid generates greedily twice
from the same cold cache: once as it is, once with every live token block
moved to another id before every step (the arena's real move, recorded for
the workers as the boundary's moves are). The moves change ids only, not
what runs: the same requests run in the same steps, so the tokens must be
the same bit for bit, and they are only if each worker copied every moved
block's KV and renamed it in the block tables it keeps
(``vllm_hybrid.v1.worker.token_moves``). A third pass moves blocks but
hides the moves from the worker: its tokens differ, which shows that the
moves reach blocks the model reads.
"""

from __future__ import annotations

import random

import pytest
from engine_utils import generate_greedy, scheduler, with_engine
from pooled_invariants import check_invariants

pytestmark = pytest.mark.slow

MiB = 2**20
OUTPUT_TOKENS = 12


def _prompts(n: int = 6, seed: int = 11) -> list[dict]:
    """Prompts of 150-450 tokens, every other one after a shared 300-token
    prefix (prefix hits within a pass: blocks held by two requests move)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 900) for _ in range(300)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 900) for _ in range(rng.randint(150, 450))]
        prompts.append({"prompt_token_ids": (shared + tail) if i % 2 else tail})
    return prompts


def _force_moves(sched, counts: dict, hide: bool = False) -> None:
    """Before each step, move every live token block to a free one (the
    boundary stays where it is). ``hide``: drop the moves from the output,
    as if the workers never heard of them."""
    from vllm_hybrid.v1.core.pooled.moves import move_live_blocks, pair_with_free

    arena = sched.kv_cache_manager.coordinator.arena
    boundary = arena.boundary
    pool = boundary.token_pool
    assert boundary.moves is not None, "the scheduler did not allow moves"
    schedule = sched.schedule

    def moving_schedule(*args, **kwargs):
        live = [b for b in pool.blocks if b.ref_cnt and not b.is_null]
        planned = pair_with_free(pool, live, range(0), set()) if live else None
        if planned:
            move_live_blocks(pool, planned, boundary.moves, boundary.coupling)
            counts["steps"] += 1
            counts["blocks"] += len(live)
        output = schedule(*args, **kwargs)
        moved = getattr(output, "hybrid_token_moves", None) or {}
        counts["sent"] += len(moved)
        if hide and moved:
            del output.hybrid_token_moves
        return output

    sched.schedule = moving_schedule


def _passes(llm) -> dict:
    sched = scheduler(llm)
    arena = sched.kv_cache_manager.coordinator.arena
    out = {"plain": generate_greedy(llm, _prompts(), OUTPUT_TOKENS).tokens}
    for name, hide in (("moved", False), ("hidden", True)):
        llm.reset_prefix_cache()
        counts = {"steps": 0, "blocks": 0, "sent": 0}
        plain_schedule = sched.schedule
        _force_moves(sched, counts, hide)
        try:
            greedy = generate_greedy(llm, _prompts(), OUTPUT_TOKENS)
        finally:
            sched.schedule = plain_schedule
        out[name] = greedy.tokens
        out[f"{name}_counts"] = counts
        out[f"{name}_hits"] = sum(greedy.cached or [])
        check_invariants(arena)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    model = str(tiny_model_dir("qwen3_5"))
    kwargs = dict(
        kv_cache_memory_bytes=48 * MiB, enable_prefix_caching=True, max_model_len=2048
    )
    return with_engine(model, True, kwargs, _passes)


def test_moved_blocks_give_the_same_tokens(runs):
    counts = runs["moved_counts"]
    assert counts["steps"] >= OUTPUT_TOKENS  # moved before every decode step
    assert counts["sent"] >= counts["blocks"] > 100
    assert runs["moved_hits"] > 0  # the shared prefix hit
    assert runs["moved"] == runs["plain"]
    assert all(len(ids) == OUTPUT_TOKENS for ids in runs["moved"])


def test_moves_the_workers_never_hear_of_change_the_tokens(runs):
    assert runs["hidden_counts"]["sent"] > 100
    assert runs["hidden"] != runs["plain"]
