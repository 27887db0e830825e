"""The loop: requests in at their modeled arrival, one engine step at a time.

The driver works on any in-process ``EngineCore`` (the stand-in engine of
:mod:`.engine`, or a real CPU engine in the tests): it adds each request the
workload says is due, steps the engine, advances the modeled clock by the
cost of the steps the executor ran, and reads what happened from the
engine's outputs (first token, prefix hits, finished requests) and its
scheduler (running requests). Nothing here decides anything the engine
decides.

``benchmarks/bench_pooled.py`` drives its real CPU engines with this loop
too: it ends a drive from a per-step hook (a preemption, a time limit) and
uses its own stall rule; requests still in flight when a run ends early are
aborted, so the engine can take the next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.tools.simulate.floor import PrefixFloor
from vllm_hybrid.tools.simulate.host import SchedulerCpu
from vllm_hybrid.tools.simulate.sources import SimRequest, Workload
from vllm_hybrid.tools.simulate.steps import StepRecord

#: Steps with requests waiting but no token scheduled, and no arrival to
#: come, after which a run ends as stalled (a request that never fits).
STALL_STEPS = 256


@dataclass
class RequestTiming:
    """Modeled times of one request (seconds on the modeled clock)."""

    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    #: prompt tokens no cache could have served (workloads that report it)
    floor_tokens: int | None = None


@dataclass
class TimelinePoint:
    time_s: float
    running: int
    waiting: int
    #: prefix hit rate of the requests started so far
    hit_rate: float


@dataclass
class DriveResult:
    """Everything a run observed; :mod:`.report` turns it into figures."""

    steps: StepRecord
    timings: dict[str, RequestTiming]
    #: running requests after each step, summed, and the largest
    running_sum: int = 0
    running_peak: int = 0
    #: running x modeled seconds, summed
    running_time: float = 0.0
    engine_steps: int = 0
    makespan_s: float = 0.0
    rejected: list[str] = field(default_factory=list)
    #: finished | stalled, or what the per-step hook ended the run with
    outcome: str = "finished"
    timeline: list[TimelinePoint] = field(default_factory=list)


def _add(core: Any, request: SimRequest) -> None:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )
    engine_request = EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=request.arrival_s,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    prepared, _ = core.preprocess_add_request(engine_request)
    core.add_request(prepared)


class Driver:
    """One run of one workload on one engine core (module docstring).

    ``take_records`` returns the executor's step records since the last
    call; ``step_seconds`` prices one of them on the modeled clock. A run is
    stalled after ``stall_steps`` steps in a row that ran nothing; ``on_step``
    sees the result after every step and ends the run with the outcome it
    returns (None: go on). With ``scheduler_cpu`` the scheduler's CPU time
    is read per engine step (:mod:`.host`).
    """

    def __init__(
        self,
        core: Any,
        workload: Workload,
        take_records: Callable[[], list[StepRecord]],
        step_seconds: Callable[[StepRecord], float],
        sample_every_s: float = 0.0,
        progress: Any = None,
        stall_steps: int = STALL_STEPS,
        on_step: Callable[[DriveResult], str | None] | None = None,
        scheduler_cpu: SchedulerCpu | None = None,
    ) -> None:
        self.core = core
        self.workload = workload
        self.take_records = take_records
        self.step_seconds = step_seconds
        self.sample_every_s = sample_every_s
        self.progress = progress
        self.stall_steps = stall_steps
        self.on_step = on_step
        self.scheduler_cpu = scheduler_cpu
        if scheduler_cpu is not None:
            scheduler_cpu.attach(core.scheduler)
        self.now = 0.0
        self.result = DriveResult(StepRecord(), {})
        self.replies: dict[str, list[int]] = {}
        #: sequences a cache could have seen, and the prompts in flight
        floor = getattr(workload, "reports_floor", False)
        self.floor = PrefixFloor() if floor else None
        self._prompts: dict[str, list[int]] = {}
        self._hit = 0
        self._prompt = 0
        self._last_sample = -1.0
        self._max_len = core.vllm_config.model_config.max_model_len

    def run(self) -> DriveResult:
        core, result = self.core, self.result
        step = core.step_fn
        idle = 0
        while True:
            self._admit()
            if not core.scheduler.has_requests() and not core.batch_queue:
                upcoming = self.workload.next_arrival()
                if upcoming is None:
                    break
                self.now = max(self.now, upcoming)
                continue
            outputs, _ = step()
            if self.scheduler_cpu is not None:
                self.scheduler_cpu.close_step()
            seconds = 0.0
            for record in self.take_records():
                result.steps.add(record)
                seconds += self.step_seconds(record)
            self.now += seconds
            self._count_running(seconds)
            if outputs:
                self._read(outputs)
            stop = None if self.on_step is None else self.on_step(result)
            if stop is not None:
                result.outcome = stop
                break
            if seconds > 0 or outputs:
                idle = 0
                continue
            # nothing could run: the next arrival may free the engine
            upcoming = self.workload.next_arrival()
            if upcoming is not None:
                self.now = max(self.now, upcoming)
                continue
            idle += 1
            if idle >= self.stall_steps:
                result.outcome = "stalled"
                break
        if result.outcome != "finished":
            unfinished = (r for r, t in result.timings.items() if t.finished is None)
            _abort(core, unfinished)
        result.makespan_s = self.now
        return result

    def _admit(self) -> None:
        for request in self.workload.due(self.now):
            if len(request.prompt) >= self._max_len:
                self.result.rejected.append(request.request_id)
                self.workload.finished(request.request_id, [], self.now)
                continue
            timing = RequestTiming(request.arrival_s, len(request.prompt))
            self.result.timings[request.request_id] = timing
            if self.floor is not None:
                timing.floor_tokens = self.floor.unserved(request.prompt)
                self.floor.add(request.prompt)
                self._prompts[request.request_id] = request.prompt
            _add(self.core, request)

    def _count_running(self, seconds: float) -> None:
        result = self.result
        scheduler = self.core.scheduler
        running = len(scheduler.running)
        result.engine_steps += 1
        result.running_sum += running
        result.running_peak = max(result.running_peak, running)
        result.running_time += running * seconds
        if self.now - self._last_sample >= self.sample_every_s:
            self._last_sample = self.now
            rate = self._hit / self._prompt if self._prompt else 0.0
            result.timeline.append(
                TimelinePoint(self.now, running, len(scheduler.waiting), rate)
            )

    def _read(self, outputs: dict[int, Any]) -> None:
        keep = self.workload.needs_replies
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                timing = self.result.timings[out.request_id]
                if out.prefill_stats is not None:
                    timing.cached_tokens = out.prefill_stats.num_cached_tokens
                    self._hit += timing.cached_tokens
                    self._prompt += timing.prompt_tokens
                if out.new_token_ids:
                    if timing.first_token is None:
                        timing.first_token = self.now
                    timing.output_tokens += len(out.new_token_ids)
                    if keep:
                        self.replies.setdefault(out.request_id, []).extend(
                            out.new_token_ids
                        )
                if out.finish_reason is not None:
                    timing.finished = self.now
                    reply = self.replies.pop(out.request_id, [])
                    if self.floor is not None:
                        prompt = self._prompts.pop(out.request_id)
                        self.floor.add(prompt + list(reply))
                    self.workload.finished(out.request_id, reply, self.now)
                    if self.progress is not None:
                        self.progress.update(1)


def _abort(core: Any, request_ids: Iterable[str]) -> None:
    ids = list(request_ids)
    if ids:
        core.abort_requests(ids)
