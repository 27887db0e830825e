"""The ``vllm-hybrid make-trace`` command line."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_hybrid.tools.plan.cli import EXIT_BAD_INPUT, BadInputParser
from vllm_hybrid.tools.plan.outputs import check_output
from vllm_hybrid.tools.plan.request import (
    parse_json_object,
    parse_positive_float,
    parse_positive_int,
)
from vllm_hybrid.tools.tracegen.agent import AgentShape, agent
from vllm_hybrid.tools.tracegen.common import (
    Line,
    prompt_lengths,
    shape_from_json,
    write_trace,
)
from vllm_hybrid.tools.tracegen.convert import (
    CONVERTERS,
    ConvertOptions,
    estimate_tokens,
    local_tokenizer,
)
from vllm_hybrid.tools.tracegen.reasoning_chat import (
    ReasoningChatShape,
    reasoning_chat,
)

#: kind -> (shape class, generator)
KINDS = {
    "reasoning-chat": (ReasoningChatShape, reasoning_chat),
    "agent": (AgentShape, agent),
}

EPILOG = """\
The file is read by `vllm-hybrid simulate MODEL --trace OUT.jsonl`. Same
kind, shape and seed give the same file. Sizes and their sources:
docs/simulation.md, "Traces with follow-ups".

Converters (--from IN): sharegpt reads ShareGPT-style conversations (a JSON
list or JSONL; conversations of {"from", "value"} or messages of {"role",
"content"}) and sends every assistant turn, later turns after the earlier
reply; custom reads a vllm bench serve custom dataset (JSONL of {"prompt",
"output_tokens"}). Token counts come from --tokenizer DIR (local files only)
or are estimated at 4 characters a token.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = BadInputParser(
        prog="vllm-hybrid make-trace",
        description="Write a request trace with follow-ups (JSONL).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=sorted([*KINDS, *CONVERTERS]))
    parser.add_argument("out", type=Path, metavar="OUT.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    convert = parser.add_argument_group("converters (sharegpt, custom)")
    convert.add_argument(
        "--from", dest="source", type=Path, metavar="IN", help="the file to convert"
    )
    convert.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="a local tokenizer directory to count tokens with (default: "
        "4 characters a token)",
    )
    convert.add_argument(
        "--request-rate",
        type=parse_positive_float,
        default=math.inf,
        metavar="R",
        help="conversations (sharegpt) or requests (custom) started per second, "
        "a Poisson process (default inf: all at once, as vllm bench serve)",
    )
    convert.add_argument(
        "--think-time-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="sharegpt: delay between a reply and the next turn (default 0)",
    )
    convert.add_argument(
        "--output-len",
        type=parse_positive_int,
        metavar="N",
        help="custom: output tokens of lines without output_tokens",
    )
    convert.add_argument(
        "--limit",
        type=parse_positive_int,
        metavar="N",
        help="convert the first N conversations or requests (default all)",
    )
    parser.add_argument(
        "--shape",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="sizes over the defaults, e.g. '{\"tasks\": 4}' (reasoning-chat: "
        f"{ReasoningChatShape()}; agent: {AgentShape()})",
    )
    return parser


def _generate(args: argparse.Namespace) -> list[Line]:
    """The lines of a generator kind; ValueError for a bad shape."""
    if args.source is not None:
        raise ValueError(f"--from is for the converters ({', '.join(CONVERTERS)})")
    shape_class, generate = KINDS[args.kind]
    shape = shape_from_json(shape_class, args.shape)
    check_output(args.out, "OUT.jsonl")
    return generate(shape, args.seed)


def _convert(args: argparse.Namespace) -> tuple[list[Line], str]:
    """The lines of a converter kind and how tokens were counted."""
    if args.source is None or not args.source.is_file():
        raise ValueError(f"{args.kind} needs --from FILE (a file that exists)")
    if args.shape:
        raise ValueError("--shape is for the generators; a converter reads --from")
    check_output(args.out, "OUT.jsonl")
    tokenize, counted = estimate_tokens, "estimated at 4 characters a token"
    if args.tokenizer is not None:
        tokenize, counted = local_tokenizer(args.tokenizer), "counted"
    options = ConvertOptions(
        request_rate=args.request_rate,
        think_time_ms=args.think_time_ms,
        output_len=args.output_len,
        limit=args.limit,
        seed=args.seed,
    )
    lines = CONVERTERS[args.kind](args.source, tokenize, options)
    if not lines:
        raise ValueError(f"--from {args.source}: no request to convert")
    return lines, counted


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counted = ""
    try:
        if args.kind in CONVERTERS:
            lines, how = _convert(args)
            counted = f"; tokens {how}"
        else:
            lines = _generate(args)
    except ValueError as exc:
        print(f"vllm-hybrid make-trace: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    count = write_trace(args.out, lines)
    lengths = sorted(prompt_lengths(lines).values())
    print(
        f"{args.out}: {count:,} requests, prompt tokens {sum(lengths):,} "
        f"(median {lengths[len(lengths) // 2]:,}, largest {lengths[-1]:,}), "
        f"output tokens {sum(line['output_length'] for line in lines):,}{counted}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
