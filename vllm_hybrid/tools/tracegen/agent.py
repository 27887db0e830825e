"""Coding-agent tasks: long shared scaffolds, growing contexts, tool calls.

A task is one agent loop: its first prompt is a scaffold (system prompt,
tool definitions and a repository map; a few scaffolds, each shared by
many tasks) and the task's description; every later step's prompt is the
previous step's prompt, then that step's whole reply, kept verbatim
(reasoning and tool call: an agent template keeps them within one task),
then the tool's output. The step is sent when the tool has run: the tool's
latency after the previous step finished.

Each task: 15-50 steps (uniform) and a final context (the last step's
prompt and reply) of 50-120k tokens (uniform); the growth up to it is
split over the steps with log-uniform weights, each step's reply
log-uniform up to half its share, the tool output the rest; tool latency
log-uniform; tasks starting as a Poisson process. Sources of these shapes
are in docs/simulation.md.
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
class AgentShape:
    """Sizes of the agent workload (tokens, seconds)."""

    tasks: int = 16
    #: distinct scaffolds (system + tools + repository map), shared by tasks
    scaffolds: int = 3
    scaffold_min: int = 8000
    scaffold_max: int = 24000
    task_min: int = 200
    task_max: int = 2000
    steps_min: int = 15
    steps_max: int = 50
    #: the last step's prompt and reply
    context_min: int = 50000
    context_max: int = 120000
    output_min: int = 50
    output_max: int = 2000
    tool_latency_min_s: float = 0.2
    tool_latency_max_s: float = 20.0
    #: mean gap between the starts of two tasks
    start_gap_s: float = 30.0

    def check(self) -> None:
        require(self.tasks >= 1, "tasks must be at least 1")
        require(self.scaffolds >= 1, "scaffolds must be at least 1")
        require(
            1 <= self.scaffold_min <= self.scaffold_max,
            "need 1 <= scaffold_min <= scaffold_max",
        )
        require(1 <= self.task_min <= self.task_max, "need 1 <= task_min <= task_max")
        require(
            2 <= self.steps_min <= self.steps_max, "need 2 <= steps_min <= steps_max"
        )
        require(
            1 <= self.output_min <= self.output_max,
            "need 1 <= output_min <= output_max",
        )
        require(self.context_min <= self.context_max, "need context_min <= context_max")
        least = (
            self.scaffold_max
            + self.task_max
            + self.output_max
            + 2 * (self.steps_max - 1)
        )
        require(
            self.context_min >= least,
            f"context_min must be at least {least:,}: the largest scaffold, task "
            "and last reply, and two tokens a step",
        )
        require(
            0 < self.tool_latency_min_s <= self.tool_latency_max_s,
            "need 0 < tool_latency_min_s <= tool_latency_max_s",
        )
        require(self.start_gap_s > 0, "start_gap_s must be above 0")


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` whole shares of log-uniform weight,
    each at least 2, summing to ``total`` exactly."""
    weights = [log_uniform(rng, 1.0, 20.0) for _ in range(parts)]
    spare = total - 2 * parts
    scale = spare / sum(weights)
    shares, given, running = [], 0, 0.0
    for weight in weights:
        running += weight * scale
        share = round(running) - given
        shares.append(2 + share)
        given += share
    return shares


def agent(shape: AgentShape, seed: int) -> list[Line]:
    """The trace's lines, task by task."""
    rng = random.Random(seed)
    hashes = HashIds()
    scaffolds = [
        text(hashes.new(), rng.randint(shape.scaffold_min, shape.scaffold_max))
        for _ in range(shape.scaffolds)
    ]
    lines: list[Line] = []
    start_s = 0.0
    for task in range(shape.tasks):
        start_s += rng.expovariate(1.0 / shape.start_gap_s)
        scaffold = scaffolds[rng.randrange(shape.scaffolds)]
        description = text(hashes.new(), rng.randint(shape.task_min, shape.task_max))
        steps = rng.randint(shape.steps_min, shape.steps_max)
        context = rng.randint(shape.context_min, shape.context_max)
        last_output = log_uniform_int(rng, shape.output_min, shape.output_max)
        growth = context - scaffold["tokens"] - description["tokens"] - last_output
        shares = _split(rng, growth, steps - 1) + [last_output]
        history = [scaffold, description]
        for step, share in enumerate(shares):
            request_id = f"a{task}/s{step}"
            if step == steps - 1:
                output = share
            else:
                drawn = log_uniform_int(rng, shape.output_min, shape.output_max)
                output = max(1, min(drawn, share // 2))
            line: Line = {"id": request_id, "segments": list(history)}
            if step == 0:
                line["timestamp"] = round(start_s * 1000)
            else:
                line["after"] = f"a{task}/s{step - 1}"
                latency = log_uniform(
                    rng, shape.tool_latency_min_s, shape.tool_latency_max_s
                )
                line["delay_ms"] = round(latency * 1000)
            line["output_length"] = output
            lines.append(line)
            if step < steps - 1:
                tool = text(hashes.new(), share - output)
                history = [*history, reply(request_id, 0), tool]
    return lines
