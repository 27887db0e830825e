"""Seeded prompts and arrival times: pure functions, so that every server of
an invocation (each mode, each dtype) gets exactly the same requests at the
same offsets."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .config import LoadShape, rate_key


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run: when to send it and what it asks for."""

    index: int
    #: Seconds after the start of the run.
    offset: float
    prompt: tuple[int, ...]
    max_tokens: int
    #: Which shared prefix it starts with (-1: none).
    prefix_group: int


def ordinary_token_ids(model_path: Path) -> list[int]:
    """Token ids a random prompt may use: the tokenizer's vocabulary minus its
    special tokens.

    The model's embedding is padded beyond the tokenizer (960 rows, 951
    tokens for the tiny models), so the ids come from ``tokenizer.json``,
    not from ``config.json``; special tokens would end a sequence or look
    like chat structure.
    """
    data = json.loads((model_path / "tokenizer.json").read_text())
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    ids = sorted(set(data["model"]["vocab"].values()) - special)
    if not ids:
        raise ValueError(f"{model_path}: no ordinary token ids")
    return ids


def poisson_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets of ``count`` requests at ``rate`` per second.

    Exponential gaps make a Poisson process: bursts and lulls as from many
    independent users, not a metronome. The first request goes at 0. An
    infinite rate sends everything at 0 (saturation).
    """
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    offsets, now = [0.0], 0.0
    for _ in range(count - 1):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def _tokens(rng: random.Random, vocab: Sequence[int], length: int) -> list[int]:
    return [rng.choice(vocab) for _ in range(length)]


def plan_run(
    shape: LoadShape, vocab: Sequence[int], seed: int, rate: float
) -> list[PlannedRequest]:
    """The requests of the run at ``rate``.

    Seeded by the rate, not by the run's position, so a rate gets the same
    requests whatever other rates an invocation runs. Each rate has its own
    prefixes: a run gets no prefix hits from the run before it on the same
    server. Arrival times have their own stream.
    """
    run = rate_key(rate)
    rng = random.Random(f"serve/{seed}/{run}/prompts")
    prefixes = [
        _tokens(rng, vocab, shape.shared_prefix_len) for _ in range(shape.prefix_groups)
    ]
    offsets = poisson_offsets(
        shape.requests, rate, random.Random(f"serve/{seed}/{run}/arrivals")
    )
    planned = []
    for index, offset in enumerate(offsets):
        if prefixes and rng.random() < shape.shared_fraction:
            group = rng.randrange(len(prefixes))
            prompt = prefixes[group] + _tokens(
                rng, vocab, rng.randint(*shape.suffix_len)
            )
        else:
            group = -1
            prompt = _tokens(rng, vocab, rng.randint(*shape.unshared_len))
        planned.append(
            PlannedRequest(
                index=index,
                offset=offset,
                prompt=tuple(prompt),
                max_tokens=rng.randint(*shape.output_len),
                prefix_group=group,
            )
        )
    return planned


def plan_warmup(vocab: Sequence[int], seed: int, count: int) -> list[PlannedRequest]:
    """Short unrelated requests sent before the first run and not measured:
    the server's first requests pay one-time costs (allocations, lazy
    imports) that would land in whichever run comes first."""
    rng = random.Random(f"serve/{seed}/warmup")
    return [
        PlannedRequest(i, 0.0, tuple(_tokens(rng, vocab, 64)), 8, -1)
        for i in range(count)
    ]


def max_prompt_tokens(shape: LoadShape) -> int:
    """Longest prompt plus output the shape can produce (must fit in
    ``--max-model-len``)."""
    shared = shape.shared_prefix_len + shape.suffix_len[1]
    return max(shared, shape.unshared_len[1]) + shape.output_len[1]
