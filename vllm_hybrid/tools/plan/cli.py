"""The ``vllm-hybrid plan`` command line: options, help text, exit codes."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_hybrid.tools.plan.compute import build_plan
from vllm_hybrid.tools.plan.pays import render_pays_table
from vllm_hybrid.tools.plan.presets import describe_presets
from vllm_hybrid.tools.plan.render import plot_concurrency, render_table
from vllm_hybrid.tools.plan.request import (
    KV_CACHE_DTYPES,
    VLLM_GPU_MEMORY_UTILIZATION,
    PlanError,
    parse_fraction,
    parse_positive_float,
    parse_positive_int,
    parse_prompt_lens,
    parse_size,
    request_from_args,
)

EXIT_BAD_INPUT = 2


class BadInputParser(argparse.ArgumentParser):
    """argparse with one-line errors, named by ``prog``, and exit code 2
    (the plan, simulate and make-trace commands)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


EPILOG = """\
Memory: --kv-cache-memory is the exact KV budget per GPU (vLLM's
--kv-cache-memory-bytes). Otherwise the budget is estimated as
--gpu-memory x --gpu-memory-utilization - --weights-memory / TP (activations,
CUDA graphs and the CUDA context are not subtracted); presets carry their
weights. --gpu-memory also picks vllm serve's CUDA defaults for that GPU.
SIZE accepts 48MiB, 10GiB, 1.5G (decimal), 1048576 (bytes).

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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say what to plan: model, device, GPU and KV budget,
    engine limits. Shared by every command that takes a model the way
    ``plan`` does; :func:`request_from_args` reads them back."""
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="local directory or file with a Hugging Face config.json, or a "
        "built-in preset (see --list-presets)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        metavar="DTYPE",
        help="KV cache dtype as for vllm serve: auto, fp8, turboquant_k8v4, ... "
        "(vLLM 0.32's values; default auto)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=parse_positive_int,
        default=1,
        metavar="N",
        help="tensor parallel size; figures are per GPU (default 1)",
    )
    memory = parser.add_argument_group("KV cache memory")
    memory.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        metavar="SIZE",
        help="exact KV cache budget per GPU (vLLM's --kv-cache-memory-bytes)",
    )
    memory.add_argument(
        "--gpu-memory",
        type=parse_positive_float,
        metavar="GiB",
        help="memory of one GPU in GiB: picks vLLM's CUDA defaults "
        "(max_num_seqs, batch tokens, CUDA graph sizes) and, without "
        "--kv-cache-memory, the budget with --gpu-memory-utilization and "
        "--weights-memory",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=parse_fraction,
        default=VLLM_GPU_MEMORY_UTILIZATION,
        metavar="F",
        help="fraction of --gpu-memory vLLM may use "
        f"(default {VLLM_GPU_MEMORY_UTILIZATION}, vLLM's)",
    )
    memory.add_argument(
        "--weights-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="weights of the whole model, split evenly over TP ranks "
        "(default: the preset's; required with --gpu-memory otherwise)",
    )
    parser.add_argument(
        "--max-model-len",
        type=parse_positive_int,
        metavar="N",
        help="maximum sequence length (default: the model's)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=parse_positive_int,
        metavar="N",
        help="maximum concurrent sequences (default: vllm serve's for the "
        "device and --gpu-memory)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=parse_positive_int,
        metavar="N",
        help="tokens per engine step (default: vllm serve's for the device "
        "and --gpu-memory)",
    )
    parser.add_argument(
        "--block-size",
        type=parse_positive_int,
        metavar="N",
        help="attention block size as for vllm serve (upstream may still "
        "inflate it for hybrid models; pooled mode keeps it)",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="SSM state dtype as for vllm serve (default auto: the model's "
        "choice; vLLM's CPU platform forces float32 on AVX512-BF16 hosts)",
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching on/off (default: vLLM's, on)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="device to plan for (default cuda)",
    )


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
def _quiet_vllm_logs() -> Iterator[None]:
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


def _check_plot_target(path: Path | None) -> None:
    """``--plot`` problems, before the seconds of planning."""
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise PlanError("--plot needs matplotlib: pip install vllm-hybrid[plot]")
    if not path.parent.is_dir():
        raise PlanError(f"--plot {path}: directory {path.parent} does not exist")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_presets:
        print(describe_presets())
        return 0
    if args.where_it_pays:
        with _quiet_vllm_logs():
            print(render_pays_table())
        return 0
    try:
        request = request_from_args(args)
        _check_plot_target(args.plot)
        with _quiet_vllm_logs():
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
