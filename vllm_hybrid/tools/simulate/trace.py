"""Request traces: the Mooncake conversation trace, as token ids.

The trace (``data/mooncake-conversation.jsonl.gz``; source and license in
``data/README.md``) gives each request's arrival time, prompt and answer
lengths and one hash id per prompt block, equal ids meaning equal content.
Prompts are made of token blocks derived from those ids alone, so equal ids
give equal blocks in every engine and process, and a shared prefix of ids is
a shared prefix of tokens; the last block is cut to the prompt's length.

Traces of this form differ in how many tokens a hash id stands for and in
the unit of their timestamps: Mooncake's ids are 512-token blocks with
millisecond timestamps, while vLLM's ``vllm bench serve --dataset-name
timed_trace`` reads 16-token ids and seconds by default
(``--timed-trace-chunk-hash-size``, ``--timed-trace-sec-multiplier``).
:class:`TraceFormat` carries both; a line whose hash ids do not cover its
input length in whole blocks of that size is refused, naming the line, since
a trace read with the wrong block size is otherwise silently misread.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The trace shipped with the package.
MOONCAKE_TRACE = Path(__file__).with_name("data") / "mooncake-conversation.jsonl.gz"
#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Seconds per timestamp unit in the Mooncake traces (milliseconds).
MOONCAKE_SECONDS_PER_UNIT = 0.001
#: Token ids below this are left out of derived prompts (special tokens of
#: common vocabularies start at 0).
FIRST_ORDINARY_ID = 3
#: The keys of a line of this form.
TRACE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line that cannot be read; the message names file and line."""


@dataclass(frozen=True)
class TraceFormat:
    """How a trace's numbers read: tokens per hash id, seconds per
    timestamp unit."""

    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    seconds_per_unit: float = MOONCAKE_SECONDS_PER_UNIT


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace."""

    index: int
    #: arrival, in seconds from the start of the trace
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def open_text(path: Path):
    """A trace file's lines (``.gz`` read as gzip)."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def parse_line(
    data: dict[str, Any], where: str, index: int, fmt: TraceFormat
) -> TraceRecord:
    """One parsed line as a record; :class:`TraceError` starting with
    ``where`` (file and line) if it is not a line of this form."""
    missing = [k for k in TRACE_KEYS if k not in data]
    if missing:
        raise TraceError(
            f"{where}: no {', '.join(missing)}; a line of this form has "
            f"{', '.join(TRACE_KEYS)}"
        )
    stamp, length, output = (
        data["timestamp"],
        data["input_length"],
        data["output_length"],
    )
    ids = data["hash_ids"]
    if (
        isinstance(stamp, bool)
        or not isinstance(stamp, (int, float))
        or not math.isfinite(stamp)
        or stamp < 0
    ):
        raise TraceError(f'{where}: "timestamp" must be a number >= 0, not {stamp!r}')
    for key, value, least in (
        ("input_length", length, 1),
        ("output_length", output, 0),
    ):
        if not _whole(value, least):
            raise TraceError(
                f'{where}: "{key}" must be a whole number >= {least}, not {value!r}'
            )
    if not isinstance(ids, list) or not all(_whole(h, 0) for h in ids):
        raise TraceError(f'{where}: "hash_ids" must be a list of whole numbers >= 0')
    check_hash_ids(len(ids), length, fmt.block_tokens, where)
    return TraceRecord(
        index=index,
        # divided by the units per second: a millisecond trace gives exactly
        # the floats of dividing by 1000
        arrival_s=float(stamp) / (1 / fmt.seconds_per_unit),
        input_length=length,
        output_length=output,
        hash_ids=tuple(ids),
    )


def check_hash_ids(count: int, input_length: int, block: int, where: str) -> None:
    """A line's hash ids must cover its input length in whole blocks:
    ``ceil(input_length / block)`` of them."""
    needed = math.ceil(input_length / block)
    if count == needed:
        return
    implied = input_length / count if count else 0
    hint = ""
    if count and not needed - 1 <= count <= needed + 1:
        hint = (
            f"; its ids stand for about {implied:,.0f} tokens each: pass "
            "--timed-trace-chunk-hash-size with the trace's block size"
        )
    raise TraceError(
        f"{where}: {count:,} hash ids for input_length {input_length:,}, but "
        f"blocks of {block} tokens need {needed:,}{hint}"
    )


def iter_lines(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    """(line number, parsed object or None, text) of every non-empty line."""
    with open_text(path) as lines:
        for number, text in enumerate(lines, 1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except ValueError:
                data = None
            yield number, data if isinstance(data, dict) else None, text


def read_trace(
    path: Path = MOONCAKE_TRACE,
    start_s: float = 0.0,
    end_s: float | None = None,
    max_requests: int | None = None,
    fmt: TraceFormat = TraceFormat(),
) -> list[TraceRecord]:
    """The records of ``path`` arriving in ``[start_s, end_s)``, at most
    ``max_requests`` of them, in arrival order; arrival times are shifted so
    that the window starts at 0. Every line is checked (:func:`parse_line`),
    the first bad one stops the reading with a :class:`TraceError`."""
    records: list[TraceRecord] = []
    for number, data, _ in iter_lines(path):
        where = f"--trace {path} line {number}"
        if data is None:
            raise TraceError(f"{where}: not a JSON object")
        if "segments" in data:
            raise TraceError(
                f"{where}: a request with follow-ups in a trace whose first line "
                "is a timed-trace line; one file holds one form"
            )
        record = parse_line(data, where, number - 1, fmt)
        if record.arrival_s < start_s or (
            end_s is not None and record.arrival_s >= end_s
        ):
            continue
        records.append(
            TraceRecord(
                record.index,
                record.arrival_s - start_s,
                record.input_length,
                record.output_length,
                record.hash_ids,
            )
        )
    records.sort(key=lambda r: (r.arrival_s, r.index))
    return records if max_requests is None else records[:max_requests]


def block_tokens(hash_id: int, vocab_size: int, length: int) -> list[int]:
    """The ``length`` token ids of one hash id's block: a pure function of
    the id (numpy's PCG64 seeded with it)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(hash_id))
    return rng.integers(FIRST_ORDINARY_ID, vocab_size, size=length).tolist()


def prompt_tokens(
    record: TraceRecord, vocab_size: int, block: int = MOONCAKE_BLOCK_TOKENS
) -> list[int]:
    """A record's prompt: one block per hash id, the last cut to length."""
    tokens: list[int] = []
    remaining = record.input_length
    for hash_id in record.hash_ids:
        take = min(block, remaining)
        if take <= 0:
            break
        tokens += block_tokens(hash_id, vocab_size, block)[:take]
        remaining -= take
    if remaining > 0:
        raise ValueError(
            f"trace record {record.index}: {len(record.hash_ids)} hash ids cover "
            f"{len(tokens)} of its {record.input_length} prompt tokens"
        )
    return tokens


def trace_stats(records: list[TraceRecord]) -> dict[str, float]:
    """Counts of a window, for the report."""
    if not records:
        return {"requests": 0}
    inputs = sorted(r.input_length for r in records)
    return {
        "requests": len(records),
        "duration_s": records[-1].arrival_s,
        "prompt_tokens": sum(inputs),
        "mean_prompt_tokens": sum(inputs) / len(inputs),
        "median_prompt_tokens": inputs[len(inputs) // 2],
        "output_tokens": sum(r.output_length for r in records),
    }
