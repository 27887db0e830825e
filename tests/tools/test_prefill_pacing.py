"""Prefill pacing on a real scheduler: the first step of a pooled engine
(the tiny qwen3_6 on the simulator's stand-in executor, no model compute)
over 5,000-token prompts, paced while few requests wait.

The tiny qwen3_6 has the flagship's per-layer shapes: one GDN layer's state
weighs 1,048 tokens of one bf16 attention layer's KV. Rounded up to the
state block, 128 tokens on the CPU platform, the page is 9 x 128 = 1,152
tokens, and a 4,096-token step budget is paced to 3 x 1,152 = 3,456. Prefill
checkpoints lie every 1,664 tokens (the budget term at 256 MiB), not on page
multiples, so chunks are still cut there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_utils import record_scheduled_tokens, stand_in_engine

from vllm_hybrid.v1.core.pooled.policy.steps import PACING_MAX_WAITING

BUDGET = 4096
PAGE = 1152
#: the first step fills the budget: two chunks cut at checkpoints, the rest
FILLED = {"r0": 1664, "r1": 1664, "r2": BUDGET - 2 * 1664}


def _unpaced(scheduler) -> None:
    """Steps fill the token budget and chunks are never cut deep in a
    prompt: the scheduler as it would be without pacing, to compare."""
    scheduler._paced_budget = None
    scheduler._deep_chunk = 0


def _first_step(
    model: Path, prompts: int, paced: bool, interval: int = 1664
) -> dict[str, int]:
    """Tokens the first step schedules per request (``interval``: between
    prefill checkpoints; ``paced``: as pooled mode ships, else unpaced)."""
    from vllm_hybrid.tools.simulate.drive import _add
    from vllm_hybrid.tools.simulate.sources import SimRequest

    with stand_in_engine(model, BUDGET, interval) as engine:
        scheduler = engine.scheduler
        assert type(scheduler).__name__ == "PooledScheduler"
        if not paced:
            _unpaced(scheduler)
        for i in range(prompts):
            prompt = [(7 * i + j) % 1000 + 1 for j in range(5000)]
            _add(engine.core, SimRequest(f"r{i}", prompt, 4, 0.0))
        assert len(scheduler.waiting) == prompts
        assert scheduler.prefill_checkpoint_interval == interval
        return dict(scheduler.schedule().num_scheduled_tokens)


@pytest.mark.parametrize(
    ("paced", "prompts", "chunks"),
    [
        # paced to 3,456: r0 cut at its checkpoint, r1 ends on a page
        # multiple, r2's 640 tokens reach none and it waits
        (True, PACING_MAX_WAITING, {"r0": 1664, "r1": PAGE}),
        # more waiting: queueing dominates, the step fills the budget
        (
            True,
            PACING_MAX_WAITING + 1,
            {"r0": 1664, "r1": 1664, "r2": BUDGET - 2 * 1664},
        ),
        (False, PACING_MAX_WAITING, {"r0": 1664, "r1": 1664, "r2": BUDGET - 2 * 1664}),
    ],
)
def test_a_paced_step_ends_chunks_on_the_state_page(
    tiny_model_dir, paced, prompts, chunks
):
    model = tiny_model_dir("qwen3_6")
    assert _first_step(model, prompts, paced) == chunks


def test_checkpoints_on_page_multiples_do_not_cut_a_paced_chunk(tiny_model_dir):
    """Checkpoints every two pages: r0's chunk runs to 3,456 past the one at
    2,304 (a paced step keeps checkpoints where chunks end on them); unpaced,
    the checkpoint cuts it."""
    model = tiny_model_dir("qwen3_6")
    paced = _first_step(model, PACING_MAX_WAITING, True, 2304)
    assert paced == {"r0": 3 * PAGE}
    filled = _first_step(model, PACING_MAX_WAITING, False, 2304)
    assert filled == {"r0": 2304, "r1": BUDGET - 2304}


def _steps(model: Path, paced: bool, steps: int) -> list[dict[str, int]]:
    """Tokens each of the first ``steps`` steps schedules per request: eight
    8,000-token prompts, a 2,048-token budget (never paced: under two
    pages), prefill checkpoints every six pages."""
    from vllm_hybrid.tools.simulate.drive import _add
    from vllm_hybrid.tools.simulate.sources import SimRequest

    with stand_in_engine(model, 2048, 6 * PAGE) as engine:
        scheduler = engine.scheduler
        if not paced:
            _unpaced(scheduler)
        for i in range(8):
            prompt = [(7 * i + j) % 1000 + 1 for j in range(8000)]
            _add(engine.core, SimRequest(f"r{i}", prompt, 4, 0.0))
        scheduled = record_scheduled_tokens(scheduler)
        while len(scheduled) < steps:
            engine.core.step_fn()
    return scheduled[:steps]


def test_deep_chunks_end_on_the_next_page(tiny_model_dir):
    """From 4,096 tokens into r0's prompt its chunks end on the next page
    (4,608, then 5,760), and those steps admit no prompt they would not
    finish: where the budget holds a page but steps are never paced, as here,
    while more than four wait. Unpaced, steps fill the budget and r1 starts
    in the fourth step."""
    model = tiny_model_dir("qwen3_6")
    deep = _steps(model, True, 4)
    assert deep == [{"r0": 2048}, {"r0": 2048}, {"r0": 512}, {"r0": PAGE}]
    filled = _steps(model, False, 4)
    assert filled == [{"r0": 2048}, {"r0": 2048}, {"r0": 2048}, {"r0": 768, "r1": 1280}]
