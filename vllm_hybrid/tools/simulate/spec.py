"""What one simulation is: the request, the workload, the engine variants.

Plain data, shared by the command line (which checks it before any engine
starts), the runner (which hands it to one worker process per variant as
JSON) and the worker (which runs it, :mod:`.session`). Nothing here imports
vLLM, so the command answers bad input without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.tools.plan.geometry import EngineOptions
from vllm_hybrid.tools.plan.request import PlanRequest
from vllm_hybrid.tools.simulate.trace import (
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_SECONDS_PER_UNIT,
    MOONCAKE_TRACE,
    TraceFormat,
)


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload, with its sizes (the shape of the chosen kind)."""

    kind: str = "mooncake"
    #: mooncake: window start and end (seconds), request cap, trace file
    start_s: float = 0.0
    end_s: float | None = None
    requests: int | None = None
    trace: str = str(MOONCAKE_TRACE)
    #: the project's workloads: field values of their shape dataclass
    shape: dict[str, Any] = field(default_factory=dict)
    #: timed-trace lines: tokens per hash id, seconds per timestamp unit
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    seconds_per_unit: float = MOONCAKE_SECONDS_PER_UNIT

    def trace_format(self) -> TraceFormat:
        return TraceFormat(self.hash_block_tokens, self.seconds_per_unit)


@dataclass(frozen=True)
class SimulationSpec:
    """What every variant of one comparison shares."""

    request: PlanRequest
    workload: WorkloadSpec
    gpu_profile: str | None = None
    weights_bytes: int | None = None
    async_scheduling: bool = False
    #: timeline resolution in modeled seconds (0: every step)
    sample_every_s: float = 0.0
    progress: bool = False
    #: each run also returns its requests, one entry each (``--per-request``)
    per_request: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SimulationSpec:
        request = dict(data["request"])
        for key in ("prompt_lens", "ignored_serve_flags"):
            request[key] = tuple(request.get(key, ()))
        return cls(
            **{
                **data,
                "request": PlanRequest(**request),
                "workload": WorkloadSpec(**data["workload"]),
            }
        )


@dataclass(frozen=True)
class Variant:
    """One engine: overlay on or off and the options it sets."""

    name: str
    overlay: bool
    cache: dict[str, Any] = field(default_factory=dict)
    hybrid_kv: dict[str, Any] = field(default_factory=dict)

    def options(self) -> EngineOptions:
        return EngineOptions(cache=self.cache, hybrid_kv=self.hybrid_kv)
