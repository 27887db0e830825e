"""The planner's errors: one line each, whatever their source says.

Every command of the tools (``plan``, ``simulate``, ``make-trace``) answers
bad input with one line on stderr and exit status 2; messages passed on from
vLLM are made one line here and shortened at a sentence or word boundary.
"""

from __future__ import annotations

import re


class PlanError(ValueError):
    """Bad input or a plan that cannot exist; one line, exit code 2."""


#: Longest error line printed (vLLM's messages can run to paragraphs).
MAX_ERROR_CHARS = 400


def unwrapped(exc: BaseException) -> str:
    """The message of ``exc`` on one line, without pydantic's wrapping."""
    text = str(exc).strip()
    # pydantic wraps the interesting line: "Value error, <message> [type=...".
    match = re.search(r"Value error, (.*?)(?: \[type=|$)", text, re.S)
    if match:
        text = match.group(1)
    return " ".join(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def shortened(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` within ``limit`` characters: its whole sentences that fit,
    else its first sentence cut at a word, marked with "...". Never cut
    inside a word."""
    if len(text) <= limit:
        return text
    kept = ""
    for sentence in _SENTENCE_END.split(text):
        longer = f"{kept} {sentence}".strip()
        if len(longer) > limit:
            break
        kept = longer
    if kept:
        return kept
    cut = text[: limit - 4].rsplit(" ", 1)[0].rstrip(" ,;:")
    return f"{cut} ..."
