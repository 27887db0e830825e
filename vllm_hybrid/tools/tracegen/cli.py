"""The ``vllm-hybrid make-trace`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_hybrid.tools.plan.cli import EXIT_BAD_INPUT, BadInputParser
from vllm_hybrid.tools.plan.request import parse_json_object
from vllm_hybrid.tools.tracegen.agent import AgentShape, agent
from vllm_hybrid.tools.tracegen.common import (
    prompt_lengths,
    shape_from_json,
    write_trace,
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
"""


def build_parser() -> argparse.ArgumentParser:
    parser = BadInputParser(
        prog="vllm-hybrid make-trace",
        description="Write a request trace with follow-ups (JSONL).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("out", type=Path, metavar="OUT.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument(
        "--shape",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="sizes over the defaults, e.g. '{\"tasks\": 4}' (reasoning-chat: "
        f"{ReasoningChatShape()}; agent: {AgentShape()})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape_class, generate = KINDS[args.kind]
    try:
        shape = shape_from_json(shape_class, args.shape)
    except ValueError as exc:
        print(f"vllm-hybrid make-trace: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    lines = generate(shape, args.seed)
    count = write_trace(args.out, lines)
    lengths = sorted(prompt_lengths(lines).values())
    print(
        f"{args.out}: {count:,} requests, prompt tokens {sum(lengths):,} "
        f"(median {lengths[len(lengths) // 2]:,}, largest {lengths[-1]:,}), "
        f"output tokens {sum(line['output_length'] for line in lines):,}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
