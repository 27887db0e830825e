"""Multi-turn chats with a reasoning model, its reasoning dropped from the
history.

Qwen3's chat templates (and Qwen3.5 / 3.6's unless ``preserve_thinking``
is set) render an earlier assistant turn without its reasoning. So each
follow-up's prompt is the conversation's earlier prompt, then the answer
part of the reply (the generated tokens from the reasoning's length on),
then the user's next message: a cache holding the earlier prompt and its
whole reply can serve only up to the end of the earlier prompt.

Each conversation: a system prompt every conversation shares, 2-8 turns
(uniform); user messages and replies of log-uniform length; the reasoning
50-90% of each reply (uniform); the user's think time between a reply and
the next message log-uniform; conversations starting as a Poisson process.
Sources of these shapes are in docs/simulation.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_hybrid.tools.tracegen.common import (
    HashIds,
    Line,
    log_uniform,
    log_uniform_int,
    reply,
    require,
    text,
)


@dataclass(frozen=True)
class ReasoningChatShape:
    """Sizes of the reasoning-chat workload (tokens, seconds)."""

    conversations: int = 64
    turns_min: int = 2
    turns_max: int = 8
    #: one system prompt, shared by every conversation
    system_tokens: int = 400
    user_min: int = 20
    user_max: int = 1500
    #: a reply: reasoning, then the answer
    output_min: int = 300
    output_max: int = 6000
    reasoning_min: float = 0.5
    reasoning_max: float = 0.9
    think_min_s: float = 5.0
    think_max_s: float = 120.0
    #: mean gap between the starts of two conversations
    start_gap_s: float = 4.0

    def check(self) -> None:
        require(self.conversations >= 1, "conversations must be at least 1")
        require(
            1 <= self.turns_min <= self.turns_max, "need 1 <= turns_min <= turns_max"
        )
        require(1 <= self.user_min <= self.user_max, "need 1 <= user_min <= user_max")
        require(
            2 <= self.output_min <= self.output_max,
            "need 2 <= output_min <= output_max (a reply has reasoning and an answer)",
        )
        require(
            0 <= self.reasoning_min <= self.reasoning_max < 1,
            "need 0 <= reasoning_min <= reasoning_max < 1 (shares of a reply)",
        )
        require(
            0 < self.think_min_s <= self.think_max_s,
            "need 0 < think_min_s <= think_max_s",
        )
        require(self.start_gap_s > 0, "start_gap_s must be above 0")


def reasoning_chat(shape: ReasoningChatShape, seed: int) -> list[Line]:
    """The trace's lines, conversation by conversation."""
    rng = random.Random(seed)
    hashes = HashIds()
    system = text(hashes.new(), shape.system_tokens) if shape.system_tokens else None
    lines: list[Line] = []
    start_s = 0.0
    for conv in range(shape.conversations):
        start_s += rng.expovariate(1.0 / shape.start_gap_s)
        history = [system] if system else []
        turns = rng.randint(shape.turns_min, shape.turns_max)
        for turn in range(turns):
            request_id = f"c{conv}/t{turn}"
            user = text(
                hashes.new(), log_uniform_int(rng, shape.user_min, shape.user_max)
            )
            output = log_uniform_int(rng, shape.output_min, shape.output_max)
            share = rng.uniform(shape.reasoning_min, shape.reasoning_max)
            reasoning = min(output - 1, round(output * share))
            line: Line = {"id": request_id, "segments": [*history, user]}
            if turn == 0:
                line["timestamp"] = round(start_s * 1000)
            else:
                line["after"] = f"c{conv}/t{turn - 1}"
                think = log_uniform(rng, shape.think_min_s, shape.think_max_s)
                line["delay_ms"] = round(think * 1000)
            line["output_length"] = output
            lines.append(line)
            history = [*history, user, reply(request_id, reasoning)]
    return lines
