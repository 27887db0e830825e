"""Request traces: the Mooncake conversation trace, as token ids.

The trace (``data/mooncake-conversation.jsonl.gz``; source and license in
``data/README.md``) gives each request's arrival time, prompt and answer
lengths and one hash id per 512-token prompt block, equal ids meaning equal
content. Prompts are made of token blocks derived from those ids alone, so
equal ids give equal blocks in every engine and process, and a shared prefix
of ids is a shared prefix of tokens; the last block is cut to the prompt's
length.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

#: The trace shipped with the package.
MOONCAKE_TRACE = Path(__file__).with_name("data") / "mooncake-conversation.jsonl.gz"
#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Token ids below this are left out of derived prompts (special tokens of
#: common vocabularies start at 0).
FIRST_ORDINARY_ID = 3


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace."""

    index: int
    #: arrival, in seconds from the start of the trace
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(
    path: Path = MOONCAKE_TRACE,
    start_s: float = 0.0,
    end_s: float | None = None,
    max_requests: int | None = None,
) -> list[TraceRecord]:
    """The records of ``path`` arriving in ``[start_s, end_s)``, at most
    ``max_requests`` of them, in arrival order; arrival times are shifted so
    that the window starts at 0."""
    opener = gzip.open if path.suffix == ".gz" else open
    records: list[TraceRecord] = []
    with opener(path, "rt") as lines:
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            data = json.loads(line)
            arrival = data["timestamp"] / 1000.0
            if arrival < start_s or (end_s is not None and arrival >= end_s):
                continue
            records.append(
                TraceRecord(
                    index=index,
                    arrival_s=arrival - start_s,
                    input_length=int(data["input_length"]),
                    output_length=int(data["output_length"]),
                    hash_ids=tuple(int(h) for h in data["hash_ids"]),
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
