"""What an engine's scheduler costs on this host's CPU, per engine step.

The stand-in executor replaces the GPU; everything else an engine core does
each step is vLLM's scheduler and KV cache manager (the overlay's, when it
is on), which run on the host's CPU on the critical path of every step.
:class:`SchedulerCpu` wraps the two scheduler methods an engine core calls
each step, ``schedule`` and ``update_from_output``, on the instance: every
call of the KV cache manager (admission, allocation, prefix lookups,
freeing) happens inside one of them, and the executor's work does not.
The wrappers add the CPU time of the calling thread (so other processes on
the host and other threads do not count) and call the original with the
same arguments: the engine behaves exactly as without them.

A benchmark reading, never a test's: CPU time depends on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

#: Scheduler methods an engine core calls each step.
TIMED_METHODS = ("schedule", "update_from_output")


@dataclass
class SchedulerCpu:
    """CPU time of the timed methods, summed per engine step."""

    #: nanoseconds of each closed step
    per_step_ns: list[int] = field(default_factory=list)
    _open_ns: int = 0

    def attach(self, scheduler: Scheduler) -> SchedulerCpu:
        """Wrap the timed methods of ``scheduler`` (the instance only)."""
        for name in TIMED_METHODS:
            setattr(scheduler, name, self._timed(getattr(scheduler, name)))
        return self

    def _timed(self, method: Any) -> Any:
        clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self._open_ns += clock() - start

        return timed

    def close_step(self) -> None:
        """End one engine step: what the timed methods spent since the last
        close is that step's."""
        self.per_step_ns.append(self._open_ns)
        self._open_ns = 0

    def summary(self) -> dict[str, Any]:
        """Total seconds, steps, and milliseconds per step (mean, p50, p99)."""
        steps = self.per_step_ns
        total = sum(steps)
        ordered = sorted(steps)

        def rank(p: int) -> float:
            if not ordered:
                return 0.0
            index = max(0, -(-p * len(ordered) // 100) - 1)
            return ordered[index] / 1e6

        return {
            "scheduler_cpu_s": total / 1e9,
            "steps": len(steps),
            "scheduler_cpu_ms_per_step": {
                "mean": total / 1e6 / len(steps) if steps else 0.0,
                "p50": rank(50),
                "p99": rank(99),
            },
        }
