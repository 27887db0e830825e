"""The scheduler CPU probe of ``vllm-hybrid simulate`` (no timing asserted:
what it sums and how it summarizes)."""

from __future__ import annotations

from vllm_hybrid.tools.simulate.host import SchedulerCpu


class _Scheduler:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def schedule(self, *args, **kwargs):
        self.calls.append(("schedule", args, kwargs))
        return "output"

    def update_from_output(self, *args, **kwargs):
        self.calls.append(("update", args, kwargs))
        return {"done": 1}


def test_wrappers_pass_arguments_and_results_through() -> None:
    scheduler = _Scheduler()
    cpu = SchedulerCpu().attach(scheduler)
    assert scheduler.schedule(1, k=2) == "output"
    assert scheduler.update_from_output("a", "b") == {"done": 1}
    assert scheduler.calls == [
        ("schedule", (1,), {"k": 2}),
        ("update", ("a", "b"), {}),
    ]
    cpu.close_step()
    cpu.close_step()  # a step that called neither method costs nothing
    assert len(cpu.per_step_ns) == 2 and cpu.per_step_ns[1] == 0


def test_time_spent_inside_counts_and_exceptions_propagate() -> None:
    class Busy:
        def schedule(self):
            total = 0
            for i in range(200_000):
                total += i
            return total

        def update_from_output(self):
            raise RuntimeError("boom")

    busy = Busy()
    cpu = SchedulerCpu().attach(busy)
    busy.schedule()
    try:
        busy.update_from_output()
    except RuntimeError:
        pass
    else:  # pragma: no cover
        raise AssertionError("the wrapper swallowed the error")
    cpu.close_step()
    assert cpu.per_step_ns[0] > 0


def test_summary_percentiles_are_nearest_rank() -> None:
    cpu = SchedulerCpu(per_step_ns=[i * 1_000_000 for i in range(1, 101)])
    summary = cpu.summary()
    assert summary["steps"] == 100
    assert summary["scheduler_cpu_s"] == sum(range(1, 101)) / 1000
    per_step = summary["scheduler_cpu_ms_per_step"]
    assert per_step["mean"] == 50.5
    assert per_step["p50"] == 50.0
    assert per_step["p99"] == 99.0
    empty = SchedulerCpu().summary()
    assert empty["steps"] == 0 and empty["scheduler_cpu_ms_per_step"]["mean"] == 0.0
