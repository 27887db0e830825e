"""What the simulator's driver gives a benchmark on top of a simulation.

``bench_pooled`` drives real CPU engines with the driver: a per-step hook
ends a drive (a preemption, a time limit) and whatever is still in flight is
aborted so the engine takes the next batch; the stall limit is the caller's.
The engine tests run the tiny qwen3_5 on the stand-in executor (no model
compute).
"""

from __future__ import annotations

from engine_utils import stand_in_engine

from vllm_hybrid.tools.simulate.drive import Driver
from vllm_hybrid.tools.simulate.sources import ManyShortShape, ManyShortWorkload

#: Four prompts of 64-128 tokens, 8 output tokens each: all four run at once.
SHAPE = ManyShortShape(requests=4, min_len=64, max_len=128, output=8)


def _driver(engine, **options) -> Driver:
    workload = ManyShortWorkload(SHAPE, list(range(3, 1000)))
    take = engine.executor.take_records
    return Driver(engine.core, workload, take, lambda _: 0.001, **options)


def test_a_hook_ends_the_run_and_what_is_left_is_aborted(tiny_model_dir):
    with stand_in_engine(tiny_model_dir("qwen3_5"), 2048, 0) as engine:
        result = _driver(
            engine, on_step=lambda r: "cut" if r.engine_steps == 3 else None
        ).run()
        assert (result.outcome, result.engine_steps) == ("cut", 3)
        # one prefill step, then two decode steps of every request
        assert [t.output_tokens for t in result.timings.values()] == [3] * 4
        assert all(t.finished is None for t in result.timings.values())
        assert engine.scheduler.get_num_unfinished_requests() == 0
        # the engine takes the next drive: all of it, to the last token
        done = _driver(engine).run()
        assert done.outcome == "finished"
        assert [t.output_tokens for t in done.timings.values()] == [8] * 4


def test_without_a_hook_a_run_ends_after_its_finished_ids_are_flushed(
    tiny_model_dir,
):
    """The simulator's own loop steps once more to hand the finished ids to
    the runner; a hook that stops when every request finished does not (the
    next run's first step hands them over)."""
    with stand_in_engine(tiny_model_dir("qwen3_5"), 2048, 0) as engine:
        ended = _driver(
            engine,
            on_step=lambda r: (
                "finished"
                if all(t.finished is not None for t in r.timings.values())
                else None
            ),
        ).run()
        plain = _driver(engine).run()
    assert (ended.outcome, plain.outcome) == ("finished", "finished")
    # prefill, then 7 decode steps (the prefill sampled the first token)
    assert (ended.engine_steps, plain.engine_steps) == (8, 9)
    assert [t.output_tokens for t in plain.timings.values()] == [8] * 4
