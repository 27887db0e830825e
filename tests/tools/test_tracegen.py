"""The trace generators of ``vllm-hybrid make-trace``: the same seed gives
the same trace, every draw stays inside its shape's bounds, and what they
write reads back through the simulator's trace reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid.tools.simulate.followups import read_followup_trace
from vllm_hybrid.tools.tracegen.agent import AgentShape, agent
from vllm_hybrid.tools.tracegen.cli import main
from vllm_hybrid.tools.tracegen.common import prompt_lengths, shape_from_json
from vllm_hybrid.tools.tracegen.reasoning_chat import (
    ReasoningChatShape,
    reasoning_chat,
)

CHAT = ReasoningChatShape(conversations=40)
AGENT = AgentShape(tasks=12)


def _by_group(lines: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for line in lines:
        groups.setdefault(line["id"].split("/")[0], []).append(line)
    return groups


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    assert reasoning_chat(CHAT, 3) == reasoning_chat(CHAT, 3)
    assert reasoning_chat(CHAT, 3) != reasoning_chat(CHAT, 4)
    assert agent(AGENT, 3) == agent(AGENT, 3)
    assert agent(AGENT, 3) != agent(AGENT, 4)


def test_reasoning_chat_drops_each_turns_reasoning_within_bounds() -> None:
    lines = reasoning_chat(CHAT, 0)
    conversations = _by_group(lines)
    assert len(conversations) == 40
    system = lines[0]["segments"][0]
    assert system["tokens"] == CHAT.system_tokens
    turn_counts = set()
    for turns in conversations.values():
        turn_counts.add(len(turns))
        assert CHAT.turns_min <= len(turns) <= CHAT.turns_max
        assert "timestamp" in turns[0] and "after" not in turns[0]
        for t, line in enumerate(turns):
            segments = line["segments"]
            assert segments[0] == system  # every conversation shares it
            quoted = [s for s in segments if "reply_of" in s]
            assert [s["reply_of"] for s in quoted] == [x["id"] for x in turns[:t]]
            for s, earlier in zip(quoted, turns[:t], strict=True):
                share = s["from"] / earlier["output_length"]
                assert CHAT.reasoning_min - 0.01 <= share <= CHAT.reasoning_max + 0.01
                assert s["from"] < earlier["output_length"]  # an answer is left
            users = [s for s in segments[1:] if "hash" in s]
            assert len(users) == t + 1
            assert all(CHAT.user_min <= u["tokens"] <= CHAT.user_max for u in users)
            assert CHAT.output_min <= line["output_length"] <= CHAT.output_max
            if t:
                assert line["after"] == turns[t - 1]["id"]
                assert 5000 <= line["delay_ms"] <= 120000
    assert len(turn_counts) > 3  # the turn count is drawn, not fixed


def test_agent_tasks_grow_to_their_context_over_shared_scaffolds() -> None:
    lines = agent(AGENT, 0)
    lengths = prompt_lengths(lines)
    tasks = _by_group(lines)
    assert len(tasks) == 12
    scaffolds = {steps[0]["segments"][0]["hash"] for steps in tasks.values()}
    assert 1 < len(scaffolds) <= AGENT.scaffolds  # shared by several tasks
    for steps in tasks.values():
        assert AGENT.steps_min <= len(steps) <= AGENT.steps_max
        head = steps[0]["segments"]
        assert AGENT.scaffold_min <= head[0]["tokens"] <= AGENT.scaffold_max
        assert AGENT.task_min <= head[1]["tokens"] <= AGENT.task_max
        last = steps[-1]
        context = lengths[last["id"]] + last["output_length"]
        assert AGENT.context_min <= context <= AGENT.context_max
        for s, line in enumerate(steps[1:], 1):
            previous = steps[s - 1]
            # the previous prompt, its whole reply, then one tool output
            assert line["segments"][:-2] == previous["segments"]
            assert line["segments"][-2] == {"reply_of": previous["id"], "from": 0}
            assert line["segments"][-1]["tokens"] >= 1
            assert line["after"] == previous["id"]
            assert 200 <= line["delay_ms"] <= 20000
            assert lengths[line["id"]] > lengths[previous["id"]]
            assert 1 <= previous["output_length"] <= AGENT.output_max


def test_written_traces_read_back(tmp_path: Path, capsys) -> None:
    for kind, shape in (("reasoning-chat", '{"conversations": 5}'), ("agent", "{}")):
        out = tmp_path / f"{kind}.jsonl"
        assert main([kind, str(out), "--seed", "7", "--shape", shape]) == 0
        records = read_followup_trace(out)
        written = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r.request_id for r in records] == [x["id"] for x in written]
        assert f"{len(records):,} requests" in capsys.readouterr().out
    written = (tmp_path / "agent.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in written] == agent(AgentShape(), 7)


def test_bad_shapes_name_the_option(capsys) -> None:
    with pytest.raises(ValueError, match=r"--shape: unknown field\(s\) \['taks'\]"):
        shape_from_json(AgentShape, {"taks": 3})
    with pytest.raises(ValueError, match="--shape: steps_min must be a whole number"):
        shape_from_json(AgentShape, {"steps_min": 2.5})
    with pytest.raises(ValueError, match="context_min must be at least 28,098"):
        shape_from_json(AgentShape, {"context_min": 20000})
    with pytest.raises(ValueError, match="reasoning_max < 1"):
        shape_from_json(ReasoningChatShape, {"reasoning_max": 1.0})
    assert main(["agent", "/dev/null", "--shape", '{"tasks": 0}']) == 2
    assert "tasks must be at least 1" in capsys.readouterr().err
    # an output that cannot be written is answered before the trace is made
    assert main(["agent", "/missing/dir/x.jsonl"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vllm-hybrid make-trace: error: OUT.jsonl /missing/dir/x.jsonl: directory "
        "/missing/dir does not exist"
    )
