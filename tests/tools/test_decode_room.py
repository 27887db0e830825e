"""A long prompt's chunks leave room for the decodes behind it.

vLLM schedules running requests in order, each taking what the step's token
budget has left. A long prompt admitted first, whose chunk a prefill
checkpoint cut short, lets a short prompt start and finish behind it; from
then on every chunk of the long prompt that the budget cuts takes the whole
budget and the short request's decode waits. Pooled mode's scheduler keeps
one token per decode behind a prefilling request (plus its draft tokens).

The engine test runs the tiny qwen3_6 on the simulator's stand-in executor
(no model compute): a 2,048-token budget, prefill checkpoints every 2,560
tokens (state block 128 on the CPU platform).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_utils import stand_in_engine

from vllm_hybrid.v1.core.pooled.policy.steps import decode_room
from vllm_hybrid.v1.core.sched import scheduler as pooled_scheduler

BUDGET = 2048
INTERVAL = 2560


def _request(rid: str, prompt: int, computed: int, output: int = 0, spec: int = 0):
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_tokens=prompt + output,
        num_computed_tokens=computed,
        spec_token_ids=[0] * spec,
    )


def test_decode_room_counts_the_decodes_after_each_prefilling_request():
    running = [
        _request("a", 9000, 2000),  # prefilling, three decodes after it
        _request("d1", 100, 100),  # decoding, no output yet
        _request("b", 9000, 4000),  # prefilling, two decodes after it
        _request("d2", 100, 103, output=3, spec=2),  # three tokens with drafts
        _request("r", 100, 50, output=10),  # resumed: replays to 109
        _request("c", 9000, 0),  # prefilling, nothing after it
    ]
    assert decode_room(running) == {"a": 1 + 3, "b": 3}
    assert decode_room([_request("x", 10, 10)]) == {}


def _steps(model: Path, monkeypatch, room: bool, steps: int) -> list[dict[str, int]]:
    """Tokens each of the first ``steps`` schedules gives each request: r0
    (8,000 tokens) arrives first, r1 (100) second."""
    from vllm_hybrid.tools.simulate.drive import _add
    from vllm_hybrid.tools.simulate.sources import SimRequest

    monkeypatch.setattr(pooled_scheduler, "DECODE_ROOM", room)
    with stand_in_engine(model, BUDGET, INTERVAL) as engine:
        scheduler = engine.scheduler
        assert type(scheduler).__name__.startswith("Pooled")
        # steps fill the token budget: the decode room alone is compared
        scheduler._paced_budget = None
        scheduler._deep_chunk = 0
        schedule = scheduler.schedule
        seen: list[dict[str, int]] = []

        def recording(*args, **kwargs):
            output = schedule(*args, **kwargs)
            seen.append(dict(output.num_scheduled_tokens))
            return output

        monkeypatch.setattr(scheduler, "schedule", recording)
        _add(
            engine.core,
            SimRequest("r0", [(3 * j) % 1000 + 1 for j in range(8000)], 4, 0.0),
        )
        _add(
            engine.core,
            SimRequest("r1", [(5 * j) % 1000 + 1 for j in range(100)], 8, 0.0),
        )
        while len(seen) < steps:
            engine.core.step_fn()
        return seen[:steps]


@pytest.mark.parametrize(
    ("room", "third"),
    [
        # r0's chunk ends on the state block before the 2,047 tokens r1's
        # decode leaves it: 2,560 + 1,920 = 4,480
        (True, {"r0": 1920, "r1": 1}),
        # upstream's order: r0 takes the budget, r1's decode waits
        (False, {"r0": BUDGET}),
    ],
)
def test_a_budget_bound_chunk_leaves_room_for_the_decodes_behind(
    tiny_model_dir, monkeypatch, room, third
):
    model = tiny_model_dir("qwen3_6")
    first, second, step3 = _steps(model, monkeypatch, room, 3)
    assert first == {"r0": BUDGET}
    # cut at the prefill checkpoint; r1 starts and finishes its prompt
    assert second == {"r0": INTERVAL - BUDGET, "r1": 100}
    assert step3 == third
