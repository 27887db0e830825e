"""Traces from what vLLM users already have.

Two inputs ``vllm bench serve`` users keep are turned into requests with
follow-ups (:mod:`vllm_hybrid.tools.simulate.followups`):

* ShareGPT-style conversations (a JSON list, or JSONL, of objects whose
  ``conversations`` hold ``{"from": "human"|"gpt"|"system", "value": ...}``
  turns, or whose ``messages`` hold ``{"role", "content"}``): each assistant
  turn becomes a request whose prompt is the conversation before it, the
  earlier replies quoted as the engine's own (``reply_of``), and whose
  output length is that reply's. Unlike bench's ``sharegpt`` dataset, which
  sends each conversation's first turn only, every turn is sent: later turns
  after the earlier one finished (and ``think_time_ms``), so follow-ups find
  their history in the cache or do not, as on a chat server.
* ``vllm bench serve --dataset-name custom`` files: JSONL lines with a
  ``prompt`` and, optionally, ``output_tokens`` (else ``output_len``), one
  request each.

Text becomes hash segments of :data:`BLOCK_TOKENS` tokens, each id a hash
of the block and the id before it, so prompts that share a prefix share
ids exactly that far (vLLM's prefix caching hashes blocks the same way).
Token counts come from a local tokenizer (``--tokenizer DIR``) or, without
one, an estimate of :data:`CHARS_PER_TOKEN` characters a token; nothing is
downloaded. Conversations or requests start as a Poisson process at
``request_rate`` per second (infinity: all at once, bench's default).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.tracegen.common import Line, reply

#: Tokens a hash segment covers (``timed_trace``'s Qwen traces hash 16).
BLOCK_TOKENS = 16
#: Characters a token is counted as without a tokenizer.
CHARS_PER_TOKEN = 4
#: The roles, in either conversation form, of the turns the model answered.
ASSISTANT = frozenset({"gpt", "assistant", "chatgpt", "bard", "model"})


@dataclass(frozen=True)
class ConvertOptions:
    """How a conversion reads and times its input."""

    #: conversations (ShareGPT) or requests (custom) started per second
    request_rate: float = math.inf
    #: delay between a reply and the next turn of its conversation
    think_time_ms: float = 0.0
    #: output length of custom lines without ``output_tokens``
    output_len: int | None = None
    #: conversations or requests to convert (None: all)
    limit: int | None = None
    seed: int = 0


Tokenize = Callable[[str], list[int] | None]


def estimate_tokens(text: str) -> None:
    """The :data:`Tokenize` of no tokenizer: None tells :func:`text_segments`
    and :func:`token_count` to count characters instead."""
    return None


def local_tokenizer(directory: Path) -> Tokenize:
    """A tokenizer read from a local directory only (no download)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {directory}: cannot load ({exc})") from None
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _hash(previous: int, piece: bytes) -> int:
    digest = hashlib.sha256(previous.to_bytes(8, "little") + piece).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def text_segments(text: str, tokenize: Tokenize, seed: int = 0) -> list[Line]:
    """Hash segments of ``text``: one per block, chained so that equal
    prefixes give equal ids."""
    ids = tokenize(text)
    if ids is None:
        step = BLOCK_TOKENS * CHARS_PER_TOKEN
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        blocks = [
            (p.encode(), max(1, math.ceil(len(p) / CHARS_PER_TOKEN))) for p in pieces
        ]
    else:
        blocks = [
            (
                json.dumps(ids[i : i + BLOCK_TOKENS]).encode(),
                len(ids[i : i + BLOCK_TOKENS]),
            )
            for i in range(0, len(ids), BLOCK_TOKENS)
        ]
    segments: list[Line] = []
    previous = seed
    for piece, tokens in blocks:
        previous = _hash(previous, piece)
        segments.append({"hash": previous, "tokens": tokens})
    return segments


def token_count(text: str, tokenize: Tokenize) -> int:
    ids = tokenize(text)
    return len(ids) if ids is not None else math.ceil(len(text) / CHARS_PER_TOKEN)


def _starts(options: ConvertOptions) -> Iterator[float]:
    """Start times in ms: a Poisson process at ``request_rate``."""
    rng = random.Random(options.seed)
    now = 0.0
    while True:
        yield now
        if math.isfinite(options.request_rate):
            now += rng.expovariate(options.request_rate) * 1000.0


def _load(path: Path) -> list[Any]:
    """A JSON list or JSONL objects."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, list):
        return data
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            raise ValueError(f"--from {path} line {number}: not JSON") from None
    return out


def _turns(entry: Any, where: str) -> list[tuple[str, str]]:
    """(role, text) of one conversation, in either form."""
    if isinstance(entry, dict) and isinstance(entry.get("conversations"), list):
        raw, role_key, text_key = entry["conversations"], "from", "value"
    elif isinstance(entry, dict) and isinstance(entry.get("messages"), list):
        raw, role_key, text_key = entry["messages"], "role", "content"
    else:
        raise ValueError(
            f"{where}: not a conversation (an object with a conversations list of "
            '{"from", "value"} or a messages list of {"role", "content"})'
        )
    turns = []
    for turn in raw:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise ValueError(f'{where}: a turn without a text "{text_key}"')
        turns.append((str(turn.get(role_key, "")).lower(), turn[text_key]))
    return turns


def from_sharegpt(
    path: Path, tokenize: Tokenize, options: ConvertOptions
) -> list[Line]:
    """Requests with follow-ups from ShareGPT-style conversations (module
    docstring)."""
    entries = _load(path)[: options.limit]
    starts = _starts(options)
    lines: list[Line] = []
    for c, entry in enumerate(entries):
        turns = _turns(entry, f"--from {path} conversation {c + 1}")
        segments: list[Line] = []
        previous: str | None = None
        start = next(starts)
        replies = 0
        for role, value in turns:
            if role not in ASSISTANT or not segments:
                segments += text_segments(value, tokenize, seed=len(segments))
                continue
            request_id = f"c{c}/t{replies}"
            replies += 1
            line: Line = {"id": request_id, "segments": list(segments)}
            line["output_length"] = max(1, token_count(value, tokenize))
            if previous is None:
                line["timestamp"] = round(start, 3)
            else:
                line["after"] = previous
                line["delay_ms"] = options.think_time_ms
            lines.append(line)
            segments.append(reply(request_id, 0))
            previous = request_id
    return lines


def from_custom(path: Path, tokenize: Tokenize, options: ConvertOptions) -> list[Line]:
    """One request per line of a ``vllm bench serve`` custom dataset."""
    entries = _load(path)[: options.limit]
    starts = _starts(options)
    lines: list[Line] = []
    for number, entry in enumerate(entries, 1):
        where = f"--from {path} line {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f'{where}: no "prompt" text')
        output = entry.get("output_tokens", options.output_len)
        if not isinstance(output, int) or isinstance(output, bool) or output < 1:
            raise ValueError(
                f'{where}: "output_tokens" must be a whole number >= 1, or give '
                "--output-len"
            )
        lines.append(
            {
                "id": f"r{number - 1}",
                "timestamp": round(next(starts), 3),
                "segments": text_segments(entry["prompt"], tokenize),
                "output_length": output,
            }
        )
    return lines


#: Converter kinds of ``make-trace``: kind -> converter.
CONVERTERS = {"sharegpt": from_sharegpt, "custom": from_custom}
