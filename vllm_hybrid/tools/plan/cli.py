"""The ``vllm-hybrid plan`` command line: options, help text, exit codes."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_hybrid.tools.plan.compute import build_plan
from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.options import add_model_arguments, request_from_args
from vllm_hybrid.tools.plan.outputs import check_plot
from vllm_hybrid.tools.plan.pays import render_pays_table
from vllm_hybrid.tools.plan.presets import describe_presets
from vllm_hybrid.tools.plan.render import plot_concurrency, render_table
from vllm_hybrid.tools.plan.request import parse_prompt_lens

EXIT_BAD_INPUT = 2


class BadInputParser(argparse.ArgumentParser):
    """argparse with one-line errors, named by ``prog``, and exit code 2
    (the plan, simulate and make-trace commands). Options are never
    abbreviated: a flag that is not the tool's goes to ``vllm serve``'s
    parser (:mod:`.serve_flags`) as it is."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


EPILOG = """\
Options: vllm serve's names (the earlier --kv-cache-memory and
--prefix-caching still work); the flags of a vllm serve line may be pasted
after MODEL: those that change nothing planned (--port, --host,
--trust-remote-code, ...) are accepted and named, others are refused by name.
The plan prints the vllm serve line it stands for.

Memory: --kv-cache-memory-bytes is the exact KV budget per GPU. Otherwise the
budget is estimated as --gpu-memory x --gpu-memory-utilization -
--weights-memory / TP (activations, CUDA graphs and the CUDA context are not
subtracted); presets carry their weights. --gpu-memory also picks vllm
serve's CUDA defaults for that GPU. SIZE accepts 48MiB, 10GiB, 30G (GiB, as
vLLM reads it), 25.6g (decimal), 1048576 (bytes).

Models: hybrid models (attention + Mamba/Mamba2/gated DeltaNet layers) get
both plans; dense attention models are planned as controls (pooled mode does
not apply, both columns agree). MLA, sliding-window and attention-free
models, and architectures vLLM does not know, are rejected (exit 2).

Devices: cuda models FlashAttention (TurboQuant for turboquant_* dtypes),
16-token default block, CUDA graphs on; cpu models CPU_ATTN, 128-token
default block and this host's SSM state dtype, exactly as the CPU engine.
Exit codes: 0 plan printed; 2 bad input or no request fits either plan.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = BadInputParser(
        prog="vllm-hybrid plan",
        description=(
            "KV cache plan of a hybrid model for vLLM 0.32 and for vllm-hybrid's "
            "pooled mode: block size, state padding, pools, token capacity, "
            "concurrency. Offline: reads config.json only, no weights, no GPU."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--list-presets",
        action="store_true",
        help="list the built-in presets and the checkpoint each stands for",
    )
    parser.add_argument(
        "--where-it-pays",
        action="store_true",
        help="plan the published hybrids on 24-141 GiB GPUs, bf16 and "
        "turboquant_k8v4 KV, and print one markdown row per case",
    )
    parser.add_argument(
        "--prompt-lens",
        type=parse_prompt_lens,
        default=[512, 2048, 8192],
        metavar="N,N,...",
        help="token counts for the concurrency and bytes-per-request rows "
        "(default 512,2048,8192; max_model_len is always added)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="write a PNG of concurrency against prompt length "
        "(needs matplotlib: pip install vllm-hybrid[plot])",
    )
    return parser


#: The planner prints a plan, not an engine's start-up: vLLM's (and the
#: transformers' it drives) warnings about kernels, Triton and runners that
#: never run here are noise. Errors still show. Levels a user sets in these
#: variables win. Logger name -> (variable of its level, the planner's level).
_QUIET_LOGGERS = {
    "vllm": ("VLLM_LOGGING_LEVEL", "ERROR"),
    "transformers": ("TRANSFORMERS_VERBOSITY", "error"),
}
#: vLLM's log lines go to stderr: stdout holds the plan (or JSON).
_VLLM_STREAM = ("VLLM_LOGGING_STREAM", "ext://sys.stderr")


@contextlib.contextmanager
def quiet_vllm_logs() -> Iterator[None]:
    """vLLM's warnings off, its log lines off stdout, for the duration.

    Both libraries read the variables when they configure logging (during
    the import in a fresh ``vllm-hybrid plan`` process), but some of vLLM's
    modules warn during that import before the configuration exists, so the
    loggers' levels are set too. Everything is restored afterwards, so a
    caller's process (tests and ``scripts/gen_docs.py`` run :func:`main`
    in-process) keeps its own settings.
    """
    defaults = dict([_VLLM_STREAM, *_QUIET_LOGGERS.values()])
    saved_env = {name: os.environ.get(name) for name in defaults}
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    saved_levels = {}
    for logger_name, (variable, _) in _QUIET_LOGGERS.items():
        level = logging.getLevelName(os.environ[variable].upper())
        if isinstance(level, int):  # an unknown name is the library's to judge
            logger = logging.getLogger(logger_name)
            saved_levels[logger] = logger.level
            logger.setLevel(level)
    try:
        yield
    finally:
        for logger, level in saved_levels.items():
            logger.setLevel(level)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.list_presets:
        print(describe_presets())
        return 0
    if args.where_it_pays:
        with quiet_vllm_logs():
            print(render_pays_table())
        return 0
    try:
        with quiet_vllm_logs():
            request = request_from_args(args, extra)
            check_plot(args.plot)
            plan = build_plan(request)
        if args.plot is not None:
            plot_concurrency(plan, args.plot)
    except PlanError as exc:
        print(f"vllm-hybrid plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
