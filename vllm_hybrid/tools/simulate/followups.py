"""Traces with follow-ups: requests whose prompts contain earlier replies.

One request a line, in JSON::

    {"id": "t3/s7", "timestamp": 1234,
     "segments": [{"hash": 17, "tokens": 6000},
                  {"reply_of": "t3/s6", "from": 0},
                  {"hash": 99, "tokens": 700}],
     "output_length": 250}

or, instead of ``timestamp`` (milliseconds from the start),
``"after": "t3/s6", "delay_ms": 2100``: sent that long after that request
finished. The prompt is its segments in order. A ``hash`` segment is
``tokens`` token ids derived from the hash alone, as the Mooncake trace's
blocks are (:func:`.trace.block_tokens`; a shorter segment of the same hash
is a prefix of a longer one). A ``reply_of`` segment is the tokens the
engine generated for that request, from output token ``from`` on (a chat
template that drops the reasoning of earlier turns keeps the reply from the
reasoning's length on). Requests may only refer to requests on earlier
lines; a request is sent once every request it refers to has finished.

Any problem with a line stops the reading with one :class:`TraceError`
naming the file, the line and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan.request import load_json_object
from vllm_hybrid.tools.simulate.trace import TRACE_KEYS, TraceError, open_text

#: The format names :func:`trace_format` tells apart.
MOONCAKE, FOLLOWUPS = "mooncake", "followups"


@dataclass(frozen=True)
class HashSegment:
    """``tokens`` token ids derived from ``hash``."""

    hash: int
    tokens: int


@dataclass(frozen=True)
class ReplySegment:
    """The reply generated for request ``reply_of``, from output token
    ``start`` on."""

    reply_of: str
    start: int


Segment = HashSegment | ReplySegment


@dataclass(frozen=True)
class FollowupRecord:
    """One request of a trace with follow-ups."""

    #: 1-based line of the file
    line: int
    request_id: str
    segments: tuple[Segment, ...]
    output_length: int
    #: arrival in seconds from the start, for requests sent at a time
    arrival_s: float | None = None
    #: the request whose end this one waits for, and how long after it
    after: str | None = None
    delay_s: float = 0.0

    def references(self) -> set[str]:
        """Ids this request waits for: its ``after`` and its replies."""
        ids = {s.reply_of for s in self.segments if isinstance(s, ReplySegment)}
        if self.after is not None:
            ids.add(self.after)
        return ids


def trace_format(path: Path) -> str:
    """:data:`MOONCAKE` or :data:`FOLLOWUPS`, from the first non-empty line."""
    with open_text(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except ValueError:
                data = None
            if isinstance(data, dict) and "segments" in data:
                return FOLLOWUPS
            if isinstance(data, dict) and "hash_ids" in data:
                return MOONCAKE
            raise TraceError(
                f"--trace {path} line {number}: neither a timed-trace line "
                f"({', '.join(TRACE_KEYS)}) nor a request with follow-ups (id, "
                "segments, output_length, timestamp or after); give a JSONL "
                "trace of one of the two forms"
            )
    raise TraceError(f"--trace {path}: no requests; give a JSONL trace")


class _LineReader:
    """Checks of one line; every failure names the file and the line."""

    def __init__(self, path: Path, number: int) -> None:
        self.where = f"--trace {path} line {number}"

    def fail(self, what: str) -> TraceError:
        return TraceError(f"{self.where}: {what}")

    def whole(self, data: dict, key: str, least: int) -> int:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise self.fail(f'"{key}" must be a whole number >= {least}, not {value!r}')
        return value

    def time(self, data: dict, key: str) -> float:
        value = data.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise self.fail(f'"{key}" must be milliseconds >= 0, not {value!r}')
        return float(value) / 1000.0

    def name(self, data: dict, key: str) -> str:
        value = data.get(key)
        if not isinstance(value, str) or not value:
            raise self.fail(f'"{key}" must be a request id (a non-empty string)')
        return value

    def segment(self, data: Any) -> Segment:
        if isinstance(data, dict) and set(data) == {"hash", "tokens"}:
            hash_id = self.whole(data, "hash", 0)
            return HashSegment(hash_id, self.whole(data, "tokens", 1))
        if isinstance(data, dict) and set(data) == {"reply_of", "from"}:
            target = self.name(data, "reply_of")
            return ReplySegment(target, self.whole(data, "from", 0))
        raise self.fail(
            f"segment {data!r} is neither "
            '{"hash": H, "tokens": N} nor {"reply_of": ID, "from": N}'
        )


def _parse(path: Path, number: int, text: str) -> FollowupRecord:
    check = _LineReader(path, number)
    try:
        data = load_json_object(text)
    except ValueError as exc:
        raise check.fail(str(exc)) from None
    if "hash_ids" in data and "segments" not in data:
        raise check.fail(
            "a timed-trace line (hash_ids) in a trace with follow-ups (its "
            "first line has segments); one file holds one form"
        )
    known = {"id", "segments", "output_length", "timestamp", "after", "delay_ms"}
    extra = sorted(set(data) - known)
    if extra:
        raise check.fail(f"unknown key(s) {extra}; known: {sorted(known)}")
    request_id = check.name(data, "id")
    segments = data.get("segments")
    if not isinstance(segments, list) or not segments:
        raise check.fail('"segments" must be a non-empty list')
    parsed = tuple(check.segment(s) for s in segments)
    output_length = check.whole(data, "output_length", 1)
    if ("timestamp" in data) == ("after" in data):
        raise check.fail('give either "timestamp" or "after" (with "delay_ms")')
    if "timestamp" in data:
        if "delay_ms" in data:
            raise check.fail('"delay_ms" goes with "after", not with "timestamp"')
        return FollowupRecord(
            number, request_id, parsed, output_length, check.time(data, "timestamp")
        )
    return FollowupRecord(
        number,
        request_id,
        parsed,
        output_length,
        after=check.name(data, "after"),
        delay_s=check.time(data, "delay_ms") if "delay_ms" in data else 0.0,
    )


def _check_references(path: Path, records: list[FollowupRecord]) -> None:
    """Every reference names a request of an earlier line, and every reply
    segment starts within that request's output."""
    lines = {}
    for record in records:
        if record.request_id in lines:
            raise TraceError(
                f"--trace {path} line {record.line}: id {record.request_id!r} "
                f"is already used on line {lines[record.request_id].line}; "
                "give each request its own id"
            )
        lines[record.request_id] = record
    for record in records:
        where = f"--trace {path} line {record.line}"
        for ref in sorted(record.references()):
            target = lines.get(ref)
            if target is None:
                raise TraceError(
                    f"{where}: refers to unknown id {ref!r}; "
                    "refer only to ids of earlier lines"
                )
            if target.line >= record.line:
                raise TraceError(
                    f"{where}: refers to {ref!r}, which comes later (line "
                    f"{target.line}); a request can only follow one on an "
                    "earlier line"
                )
        for segment in record.segments:
            if isinstance(segment, ReplySegment):
                total = lines[segment.reply_of].output_length
                if segment.start > total:
                    raise TraceError(
                        f"{where}: reply of {segment.reply_of!r} from token "
                        f"{segment.start}, past the {total} tokens it generates; "
                        f'"from" must be at most its output_length'
                    )


def read_followup_trace(
    path: Path, max_requests: int | None = None
) -> list[FollowupRecord]:
    """The records of ``path`` in line order (the first ``max_requests``);
    :class:`TraceError` on the first bad line."""
    records: list[FollowupRecord] = []
    with open_text(path) as lines:
        for number, text in enumerate(lines, 1):
            if text.strip():
                records.append(_parse(path, number, text))
    if not records:
        raise TraceError(f"--trace {path}: no requests; give a JSONL trace")
    _check_references(path, records)
    return records if max_requests is None else records[:max_requests]


def prompt_of(
    record: FollowupRecord, replies: dict[str, list[int]], vocab_size: int
) -> list[int]:
    """A record's prompt: its segments' tokens in order; ``replies`` holds
    the generated tokens of every request a reply segment names."""
    from vllm_hybrid.tools.simulate.trace import block_tokens

    tokens: list[int] = []
    for segment in record.segments:
        if isinstance(segment, HashSegment):
            tokens += block_tokens(segment.hash, vocab_size, segment.tokens)
        else:
            tokens += replies[segment.reply_of][segment.start :]
    return tokens
