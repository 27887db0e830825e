"""The ``vllm-hybrid simulate`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_hybrid.tools.plan.cli import (
    EXIT_BAD_INPUT,
    BadInputParser,
    add_model_arguments,
)
from vllm_hybrid.tools.plan.presets import PRESETS
from vllm_hybrid.tools.plan.request import (
    PlanError,
    parse_json_object,
    parse_positive_int,
    request_from_args,
)
from vllm_hybrid.tools.simulate.clock import GPU_PROFILES
from vllm_hybrid.tools.simulate.followups import (
    FOLLOWUPS,
    read_followup_trace,
    trace_format,
)
from vllm_hybrid.tools.simulate.runner import (
    DEFAULT_CHECKPOINT_SWEEP,
    DEFAULT_RETENTION_SWEEP,
    DEFAULT_STATE_BLOCK_SWEEP,
    ENGINES,
    engine_variants,
    run_engines,
)
from vllm_hybrid.tools.simulate.session import SimulationSpec, WorkloadSpec
from vllm_hybrid.tools.simulate.sources import ChatServerShape, MultiTurnShape
from vllm_hybrid.tools.simulate.trace import MOONCAKE_TRACE

WORKLOADS = ("mooncake", "chat_server", "multi_turn", "many_short")

EPILOG = """\
Every scheduling and caching decision is vLLM 0.32's engine core (and the
overlay's, for single-pool and pooled engines) at the model's geometry on the
device asked; the model's forward pass is a stand-in that returns
deterministic tokens. Figures marked "counted" are what the engines did;
figures marked "modeled" come from a documented cost model
(docs/simulation.md). Each engine runs in its own process.
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
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="mooncake")
    work.add_argument(
        "--trace",
        type=Path,
        default=MOONCAKE_TRACE,
        help="JSONL trace (.gz ok) of the mooncake workload: Mooncake's lines, or "
        "requests with follow-ups (docs/simulation.md; vllm-hybrid make-trace "
        "writes them)",
    )
    work.add_argument(
        "--window",
        type=_window,
        default=(0.0, None),
        metavar="START:END",
        help="trace requests arriving in this window, seconds (default all)",
    )
    work.add_argument(
        "--requests", type=parse_positive_int, help="at most this many requests"
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
    engines = parser.add_argument_group("engines")
    engines.add_argument(
        "--engines",
        type=_names,
        default=list(ENGINES),
        metavar="A,B,...",
        help=f"engines to compare (default all: {','.join(ENGINES)})",
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
        "pooled-best), as in --additional-config",
    )
    engines.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's async scheduling (default: on for cuda, off for cpu, "
        "as vLLM picks)",
    )
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
    run.add_argument("--json", type=Path, metavar="OUT.json", help="write JSON")
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


def _check_trace(path: Path, window: tuple[float, float | None]) -> None:
    """Read a trace with follow-ups here, so that a bad line stops the
    command before any engine starts (:class:`ValueError` naming it)."""
    if not path.is_file():
        raise ValueError(f"--trace {path}: no such file; give a JSONL trace")
    if trace_format(path) != FOLLOWUPS:
        return
    if window != (0.0, None):
        raise ValueError(
            "--window: a trace with follow-ups is cut with --requests N "
            "(its first N lines), not by time"
        )
    read_followup_trace(path)


def spec_from_args(args: argparse.Namespace) -> SimulationSpec:
    """The simulation the arguments ask for; :class:`PlanError` if bad."""
    request = request_from_args(args)
    start, end = args.window
    if args.workload == "mooncake":
        _check_trace(args.trace, args.window)
    workload = WorkloadSpec(
        kind=args.workload,
        start_s=start,
        end_s=end,
        requests=args.requests,
        trace=str(args.trace),
        shape=dict(args.shape),
    )
    weights = args.weights_memory
    if weights is None and args.model in PRESETS:
        weights = PRESETS[args.model].weights_bytes
    async_scheduling = args.async_scheduling
    if async_scheduling is None:
        async_scheduling = request.device == "cuda"
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    duration = (end - start) if end is not None else 3600.0
    return SimulationSpec(
        request=request,
        workload=workload,
        gpu_profile=args.gpu_profile,
        weights_bytes=weights,
        async_scheduling=async_scheduling,
        sample_every_s=duration / 2000 if args.workload == "mooncake" else 0.0,
        progress=progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_hybrid.tools.simulate.report import (
        plot_timeline,
        render_sweeps,
        render_table,
    )

    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        variants = engine_variants(
            args.engines,
            args.retention_sweep,
            args.checkpoint_sweep,
            args.hybrid_kv,
            args.state_block_sweep,
        )
    except (PlanError, ValueError) as exc:
        print(f"vllm-hybrid simulate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    engines = run_engines(spec, variants, jobs=args.jobs)
    result = {"spec": spec.to_json(), "engines": engines}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot is not None:
        plot_timeline(engines, args.plot)
    print(render_table(engines))
    sweeps = render_sweeps(engines)
    if sweeps:
        print("\nSweeps:\n" + sweeps)
    failed = any("error" in run for e in engines.values() for run in e["runs"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
