"""Everything a simulation is checked for before any engine starts.

A simulation runs for minutes; a mistake found by an engine costs the run
and is reported from inside a worker. So the command checks here, in its
own process and in this order: the workload (every line of a trace, in
either form, with its path and line number; the shape's fields, as
``make-trace`` checks its own), the output paths, and then, with vLLM
imported once, the plan of the request (:func:`~vllm_hybrid.tools.plan.
compute.build_plan`): the engines' own start-up planning decides whether one
request of max_model_len fits, and whether upstream would refuse to start,
for the modes of the engines asked for. Each failure is one
:class:`~vllm_hybrid.tools.plan.errors.PlanError` or ``ValueError`` line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid.tools.plan.compute import Plan, build_plan
from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.limits import MODE_NAMES, length_shortfall
from vllm_hybrid.tools.plan.messages import with_flag_names
from vllm_hybrid.tools.simulate.followups import (
    FOLLOWUPS,
    read_followup_trace,
    trace_format,
)
from vllm_hybrid.tools.simulate.sources import CLOSED_LOOP
from vllm_hybrid.tools.simulate.spec import SimulationSpec, Variant, WorkloadSpec
from vllm_hybrid.tools.simulate.trace import MOONCAKE_TRACE, read_trace
from vllm_hybrid.tools.tracegen.common import shape_from_json

#: Requests a trace is cut to when neither ``--requests`` nor ``--window``
#: says otherwise: a run of minutes, not the hour.
DEFAULT_REQUESTS = 1000


@dataclass(frozen=True)
class WorkloadFacts:
    """What the header says of the workload."""

    #: the trace's form, or the closed-loop workload's name and shape
    description: str
    #: requests the trace holds in all, and those simulated (None: not a
    #: trace, the shape decides)
    total: int | None = None
    selected: int | None = None
    #: seconds between the first and the last arrival simulated
    span_s: float | None = None
    #: the vendored Mooncake trace cut short (the header says how to run it
    #: whole)
    cut_vendored: bool = False


def workload_facts(workload: WorkloadSpec) -> WorkloadFacts:
    """Read and check the workload: every line of a trace, or the shape of
    a closed-loop workload; what the header says of it."""
    if workload.kind in CLOSED_LOOP:
        shape = shape_from_json(CLOSED_LOOP[workload.kind][0], workload.shape)
        return WorkloadFacts(f"{workload.kind} {shape}")
    if workload.shape:
        raise PlanError(
            f"--shape sets the sizes of {', '.join(CLOSED_LOOP)}; a trace has "
            "none (cut it with --requests)"
        )
    path = Path(workload.trace)
    if not path.is_file():
        raise PlanError(f"--trace {path}: no such file; give a JSONL trace")
    if trace_format(path) == FOLLOWUPS:
        if (workload.start_s, workload.end_s) != (0.0, None):
            raise PlanError(
                "--window: a trace with follow-ups is cut with --requests N "
                "(its first N lines), not by time"
            )
        lines = read_followup_trace(path)
        selected = len(lines[: workload.requests])
        return WorkloadFacts(f"{path} (requests with follow-ups)", len(lines), selected)
    fmt = workload.trace_format()
    every = read_trace(path, fmt=fmt)
    start, end = workload.start_s, workload.end_s
    records = read_trace(path, start, end, workload.requests, fmt)
    vendored = path.resolve() == MOONCAKE_TRACE.resolve()
    name = "the Mooncake conversation trace" if vendored else str(path)
    return WorkloadFacts(
        f"{name} ({fmt.block_tokens}-token hash ids)",
        len(every),
        len(records),
        records[-1].arrival_s if records else 0.0,
        cut_vendored=vendored and len(records) < len(every),
    )


def engine_modes(variants: Mapping[str, Sequence[Variant]]) -> dict[str, list[str]]:
    """Planner mode -> the engines that run in it (upstream: overlay off;
    pooled: overlay on with pooled mode; single_pool: overlay on, pooled
    mode off)."""
    modes: dict[str, list[str]] = {}
    for engine, runs in variants.items():
        for variant in runs:
            if not variant.overlay:
                mode = "upstream"
            elif variant.hybrid_kv.get("pooled", True) is not False:
                mode = "pooled"
            else:
                mode = "single_pool"
            if engine not in modes.setdefault(mode, []):
                modes[mode].append(engine)
    return modes


def check_plan(
    plan: Plan, spec: SimulationSpec, modes: Mapping[str, list[str]]
) -> None:
    """The engines asked for can start: one request of max_model_len fits
    each of their modes (one number to lower it to), none of them fails to
    plan, and upstream would not refuse its full CUDA graphs."""
    planned = {m: getattr(plan, m) for m in modes}
    shortfall = length_shortfall(spec.request, plan.max_model_len, planned)
    if shortfall is not None:
        raise PlanError(shortfall)
    for mode, figures in planned.items():
        engines = ", ".join(modes[mode])
        if figures.error:
            raise PlanError(
                f"{MODE_NAMES[mode]} cannot run this ({engines}): {figures.error}"
            )
        if figures.refusal:
            raise PlanError(
                f"{MODE_NAMES[mode]} refuses to start here (engines {engines}), in "
                f"vLLM's words: {with_flag_names(figures.refusal)} (--engines "
                "pooled runs pooled mode alone)"
            )


def preflight(
    spec: SimulationSpec, variants: Mapping[str, Sequence[Variant]]
) -> tuple[Plan, WorkloadFacts]:
    """The plan and the workload's facts, once every check has passed."""
    facts = workload_facts(spec.workload)
    modes = engine_modes(variants)
    plan = build_plan(spec.request, single_pool="single_pool" in modes, strict=False)
    check_plan(plan, spec, modes)
    return plan, facts
