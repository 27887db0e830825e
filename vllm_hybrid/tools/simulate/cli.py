"""The ``vllm-hybrid simulate`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan.cli import EXIT_BAD_INPUT, BadInputParser, quiet_vllm_logs
from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.options import add_model_arguments, request_from_args
from vllm_hybrid.tools.plan.outputs import check_output, check_plot
from vllm_hybrid.tools.plan.request import (
    parse_json_object,
    parse_positive_float,
    parse_positive_int,
)
from vllm_hybrid.tools.simulate.clock import GPU_PROFILES
from vllm_hybrid.tools.simulate.preflight import DEFAULT_REQUESTS, preflight
from vllm_hybrid.tools.simulate.runner import (
    DEFAULT_CHECKPOINT_SWEEP,
    DEFAULT_RETENTION_SWEEP,
    DEFAULT_STATE_BLOCK_SWEEP,
    ENGINES,
    engine_variants,
    run_engines,
)
from vllm_hybrid.tools.simulate.sources import ChatServerShape, MultiTurnShape
from vllm_hybrid.tools.simulate.spec import SimulationSpec, WorkloadSpec
from vllm_hybrid.tools.simulate.trace import (
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_SECONDS_PER_UNIT,
    MOONCAKE_TRACE,
)

WORKLOADS = ("mooncake", "chat_server", "multi_turn", "many_short")
#: The engines of a run that names none: upstream as installed and pooled
#: mode, one process each.
DEFAULT_ENGINES = ("upstream", "pooled")
#: ``--requests all``: every request of the trace.
ALL = "all"

EPILOG = f"""\
Every scheduling and caching decision is vLLM 0.32's engine core (and the
overlay's, for single-pool and pooled engines) at the model's geometry on the
device asked; the model's forward pass is a stand-in that returns
deterministic tokens. Figures marked "counted" are what the engines did;
figures marked "modeled" come from a documented cost model
(docs/simulation.md). Each engine runs in its own process.

Default run: the first {DEFAULT_REQUESTS:,} requests of the Mooncake trace,
upstream and pooled; --requests all runs the whole hour. Everything given is
checked before an engine starts (exit 2 with one line). The options shared
with vllm serve take its names, and a vllm serve line's flags may be pasted
after MODEL (as for vllm-hybrid plan). --json holds every run's figures, the
ones vllm bench serve also reports under its key names (median_ttft_ms,
p99_tpot_ms, request_throughput, ...); --per-request writes one JSON line per
request and engine.
"""


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _tokens(text: str) -> list[str]:
    values = _names(text)
    bad = [v for v in values if not v.isdigit()]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad)}: not a whole number of tokens (0 turns them off)"
        )
    return values


def _window(text: str) -> tuple[float, float | None]:
    start, _, end = text.partition(":")
    try:
        return float(start or 0), (float(end) if end else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not START:END in seconds (e.g. 0:600)"
        ) from None


def _requests(text: str) -> int | str:
    return ALL if text == ALL else parse_positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = BadInputParser(
        prog="vllm-hybrid simulate",
        description=(
            "vLLM's engine core on a request trace at a real model's geometry, "
            "with the forward pass replaced: upstream vLLM 0.32 (defaults and "
            "best flags), the overlay's single pool and pooled mode side by side."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.set_defaults(prompt_lens=[])
    _add_workload_arguments(parser)
    _add_engine_arguments(parser)
    run = parser.add_argument_group("clock and output")
    run.add_argument(
        "--gpu-profile",
        choices=sorted(GPU_PROFILES),
        help="data sheet figures of the modeled clock (default: the profile "
        "closest to --gpu-memory)",
    )
    run.add_argument(
        "--jobs",
        type=parse_positive_int,
        default=min(4, os.cpu_count() or 1),
        help="engine processes at once (default: CPUs, at most 4)",
    )
    run.add_argument(
        "--json",
        type=Path,
        metavar="OUT.json",
        help="write JSON: the header's facts and every run's figures, with vllm "
        "bench serve's key names (in ms) under bench_serve",
    )
    run.add_argument(
        "--per-request",
        type=Path,
        metavar="OUT.jsonl",
        help="write one JSON line per request and engine: arrival, TTFT, TPOT, "
        "hit and prefill tokens",
    )
    run.add_argument(
        "--plot", type=Path, metavar="OUT.png", help="running and hit rate over time"
    )
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars (default: on a terminal)",
    )
    return parser


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="mooncake")
    work.add_argument(
        "--trace",
        type=Path,
        default=MOONCAKE_TRACE,
        help="JSONL trace (.gz ok) of the mooncake workload: timed-trace lines "
        "(timestamp, input_length, output_length, hash_ids, as vllm bench serve "
        "--dataset-name timed_trace reads them), or requests with follow-ups "
        "(docs/simulation.md; vllm-hybrid make-trace writes them)",
    )
    work.add_argument(
        "--timed-trace-chunk-hash-size",
        "--hash-block-size",
        dest="hash_block_tokens",
        type=parse_positive_int,
        default=MOONCAKE_BLOCK_TOKENS,
        metavar="N",
        help=f"tokens each hash id stands for (default {MOONCAKE_BLOCK_TOKENS}, "
        "Mooncake's; vllm bench serve's default is 16, as in Qwen's traces)",
    )
    work.add_argument(
        "--timed-trace-sec-multiplier",
        dest="seconds_per_unit",
        type=parse_positive_float,
        default=MOONCAKE_SECONDS_PER_UNIT,
        metavar="F",
        help=f"seconds per timestamp unit (default {MOONCAKE_SECONDS_PER_UNIT}: "
        "milliseconds, Mooncake's; vllm bench serve's default is 1)",
    )
    work.add_argument(
        "--window",
        type=_window,
        default=None,
        metavar="START:END",
        help="trace requests arriving in this window, seconds (default all)",
    )
    work.add_argument(
        "--requests",
        type=_requests,
        default=None,
        metavar="N|all",
        help=f"the first N requests of a trace (default {DEFAULT_REQUESTS:,}, or "
        "all of a --window); all: every request (the Mooncake trace's whole hour)",
    )
    work.add_argument(
        "--shape",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="sizes of chat_server / multi_turn / many_short, e.g. "
        '\'{"conversations": 256, "concurrency": 64}\' '
        f"(chat_server defaults: {ChatServerShape()}; multi_turn: "
        f"{MultiTurnShape()})",
    )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engines = parser.add_argument_group("engines")
    engines.add_argument(
        "--engines",
        type=_names,
        default=list(DEFAULT_ENGINES),
        metavar="A,B,...",
        help=f"engines to compare (default {','.join(DEFAULT_ENGINES)}; known: "
        f"{','.join(ENGINES)})",
    )
    engines.add_argument(
        "--retention-sweep",
        type=_names,
        default=list(DEFAULT_RETENTION_SWEEP),
        metavar="V,V,...",
        help="upstream-best's --prefix-cache-retention-interval values: tokens, "
        "'dense', or Nx (N scheduler blocks) "
        f"(default {','.join(DEFAULT_RETENTION_SWEEP)})",
    )
    engines.add_argument(
        "--checkpoint-sweep",
        type=_tokens,
        default=list(DEFAULT_CHECKPOINT_SWEEP),
        metavar="N,N,...",
        help="pooled-best's hybrid_kv.prefill_checkpoint_interval values, tokens "
        "(0: none) "
        f"(default {','.join(DEFAULT_CHECKPOINT_SWEEP)})",
    )
    engines.add_argument(
        "--state-block-sweep",
        type=_tokens,
        default=list(DEFAULT_STATE_BLOCK_SWEEP),
        metavar="N,N,...",
        help="pooled-best's --mamba-block-size values on top, tokens: multiples "
        "of the attention block; states are kept only at their multiples "
        "(default none)",
    )
    engines.add_argument(
        "--hybrid-kv",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="hybrid_kv options of the overlay's engines (single-pool, pooled, "
        "pooled-best) only, as in --additional-config",
    )
    engines.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's async scheduling (default: on for cuda, off for cpu, "
        "as vLLM picks)",
    )


def _cut(args: argparse.Namespace) -> int | None:
    """The request cap: ``--requests``, else all of a ``--window``, else
    :data:`DEFAULT_REQUESTS`."""
    if args.requests == ALL:
        return None
    if args.requests is not None:
        return args.requests
    return None if args.window is not None else DEFAULT_REQUESTS


def spec_from_args(
    args: argparse.Namespace, extra: Sequence[str] = ()
) -> SimulationSpec:
    """The simulation the arguments ask for; :class:`PlanError` if bad."""
    request = request_from_args(args, extra, tool="simulate")
    start, end = args.window or (0.0, None)
    workload = WorkloadSpec(
        kind=args.workload,
        start_s=start,
        end_s=end,
        requests=_cut(args),
        trace=str(args.trace),
        shape=dict(args.shape),
        hash_block_tokens=args.hash_block_tokens,
        seconds_per_unit=args.seconds_per_unit,
    )
    async_scheduling = args.async_scheduling
    if async_scheduling is None:
        async_scheduling = request.device == "cuda"
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    duration = (end - start) if end is not None else 3600.0
    return SimulationSpec(
        request=request,
        workload=workload,
        gpu_profile=args.gpu_profile,
        weights_bytes=request.weights_bytes,
        async_scheduling=async_scheduling,
        sample_every_s=duration / 2000 if args.workload == "mooncake" else 0.0,
        progress=progress,
        per_request=args.per_request is not None,
    )


def _check_outputs(args: argparse.Namespace) -> None:
    check_output(args.json, "--json")
    check_output(args.per_request, "--per-request")
    check_plot(args.plot)


def _check_hybrid_kv(variants: Mapping[str, Sequence[Any]]) -> None:
    """Every overlay engine's ``hybrid_kv`` options are valid."""
    from vllm_hybrid.config.hybrid_kv import options_error

    for runs in variants.values():
        for variant in runs:
            problem = options_error({"hybrid_kv": dict(variant.hybrid_kv)})
            if problem is not None:
                raise PlanError(f"--hybrid-kv: {problem}")


def write_per_request(engines: Mapping[str, Any], path: Path) -> int:
    """Move every run's request rows out of ``engines`` into ``path`` (one
    JSON line each, named by engine and run); the number written."""
    count = 0
    with path.open("w") as out:
        for engine, entry in engines.items():
            for run, summary in entry["runs"].items():
                for row in summary.pop("requests", None) or ():
                    line = {"engine": engine, "run": run, **row}
                    out.write(json.dumps(line, separators=(",", ":")) + "\n")
                    count += 1
    return count


def _rejected_notes(engines: Mapping[str, Any]) -> list[str]:
    """Requests no engine was sent (longer than max_model_len)."""
    rejected = {
        (summary.get("counted") or {}).get("rejected") or 0
        for entry in engines.values()
        for summary in entry["runs"].values()
    }
    most = max(rejected, default=0)
    if not most:
        return []
    return [
        f"note: {most:,} requests of the workload are at least max_model_len "
        "tokens long and were not sent (--max-model-len)"
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_hybrid.tools.simulate.header import (
        header_facts,
        plot_title,
        render_header,
    )
    from vllm_hybrid.tools.simulate.report import (
        plot_timeline,
        render_sweeps,
        render_table,
    )
    from vllm_hybrid.tools.simulate.verdict import verdict_lines

    args, extra = build_parser().parse_known_args(argv)
    try:
        with quiet_vllm_logs():
            spec = spec_from_args(args, extra)
            variants = engine_variants(
                args.engines,
                args.retention_sweep,
                args.checkpoint_sweep,
                args.hybrid_kv,
                args.state_block_sweep,
            )
            _check_hybrid_kv(variants)
            _check_outputs(args)
            plan, facts = preflight(spec, variants)
    except (PlanError, ValueError) as exc:
        print(f"vllm-hybrid simulate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    header = render_header(spec, plan, facts, list(variants))
    print(header, flush=True)
    engines = run_engines(spec, variants, jobs=args.jobs)
    if args.per_request is not None:
        write_per_request(engines, args.per_request)
    result = {
        "spec": spec.to_json(),
        "header": header_facts(spec, plan, facts, list(variants)),
        "engines": engines,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot is not None:
        plot_timeline(engines, args.plot, plot_title(spec, plan, facts))
    print()
    print(render_table(engines))
    lines = [*verdict_lines(engines), *_rejected_notes(engines)]
    if lines:
        print("\n" + "\n".join(lines))
    sweeps = render_sweeps(engines)
    if sweeps:
        print("\nSweeps:\n" + sweeps)
    failed = any("error" in run for e in engines.values() for run in e["runs"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
