"""What the trace generators share: draws, hash ids, lengths, the writer."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: A request line, as :mod:`vllm_hybrid.tools.simulate.followups` reads it.
Line = dict[str, Any]


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A draw whose logarithm is uniform in ``[log low, log high]``: sizes
    that spread over orders of magnitude, most of them small."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    return min(high, max(low, round(log_uniform(rng, low, high))))


class HashIds:
    """Fresh hash ids, one per piece of distinct content (1, 2, ...)."""

    def __init__(self) -> None:
        self.last = 0

    def new(self) -> int:
        self.last += 1
        return self.last


def text(hash_id: int, tokens: int) -> dict[str, int]:
    """A hash segment."""
    return {"hash": hash_id, "tokens": tokens}


def reply(request_id: str, start: int) -> dict[str, Any]:
    """A reply segment: ``request_id``'s output from token ``start`` on."""
    return {"reply_of": request_id, "from": start}


def prompt_lengths(lines: Iterable[Line]) -> dict[str, int]:
    """Request id -> prompt tokens (an engine generates exactly
    ``output_length`` tokens, so a reply segment's length is known)."""
    outputs: dict[str, int] = {}
    lengths: dict[str, int] = {}
    for line in lines:
        total = 0
        for segment in line["segments"]:
            if "hash" in segment:
                total += segment["tokens"]
            else:
                total += outputs[segment["reply_of"]] - segment["from"]
        lengths[line["id"]] = total
        outputs[line["id"]] = line["output_length"]
    return lengths


def write_trace(path: Path, lines: Iterable[Line]) -> int:
    """Write ``lines`` as JSONL; the number written."""
    count = 0
    with path.open("w") as out:
        for line in lines:
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
            count += 1
    return count


def shape_from_json(shape_class: type, values: Mapping[str, Any]) -> Any:
    """``shape_class`` with ``values`` over its defaults; :class:`ValueError`
    naming ``--shape`` for an unknown field, a wrong type or a bound
    that does not hold (the class's ``check``)."""
    fields = {f.name: f for f in dataclasses.fields(shape_class)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"--shape: unknown field(s) {unknown}; known: {sorted(fields)}"
        )
    for name, value in values.items():
        default = getattr(shape_class, name)
        kinds = (int,) if isinstance(default, int) else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
            kind = "a whole number" if kinds == (int,) else "a number"
            raise ValueError(f"--shape: {name} must be {kind} >= 0, not {value!r}")
    shape = shape_class(**values)
    shape.check()
    return shape


def require(condition: bool, message: str) -> None:
    """A shape bound: :class:`ValueError` naming ``--shape`` unless it holds."""
    if not condition:
        raise ValueError(f"--shape: {message}")
