"""Traces with follow-ups: the reader's errors, when requests go out, what
their prompts hold, and the floor (prompt tokens no cache could serve).

The engine test drives the stand-in engine of ``vllm-hybrid simulate`` on
a tiny model's geometry with a hand-made trace: a reply segment must hold
exactly the tokens the engine generated for the request it names, and the
floor must be the hand-counted number.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid.tools.simulate.floor import PrefixFloor
from vllm_hybrid.tools.simulate.followups import (
    FOLLOWUPS,
    MOONCAKE,
    TraceError,
    read_followup_trace,
    trace_format,
)
from vllm_hybrid.tools.simulate.sources import FollowupWorkload
from vllm_hybrid.tools.simulate.trace import MOONCAKE_TRACE, block_tokens

VOCAB = 951  # the tiny models' tokenizer

#: a: a 3,100-token prompt; c: shares 2,000 of it; b: a's prompt, a's
#: answer after 20 reasoning tokens, 40 new; d: b's prompt and whole reply,
#: 16 new.
TRACE = [
    {
        "id": "a",
        "timestamp": 0,
        "segments": [{"hash": 17, "tokens": 3000}, {"hash": 5, "tokens": 100}],
        "output_length": 50,
    },
    {
        "id": "c",
        "timestamp": 500,
        "segments": [{"hash": 17, "tokens": 2000}, {"hash": 8, "tokens": 100}],
        "output_length": 10,
    },
    {
        "id": "b",
        "after": "a",
        "delay_ms": 1000,
        "segments": [
            {"hash": 17, "tokens": 3000},
            {"hash": 5, "tokens": 100},
            {"reply_of": "a", "from": 20},
            {"hash": 6, "tokens": 40},
        ],
        "output_length": 30,
    },
    {
        "id": "d",
        "after": "b",
        "segments": [
            {"hash": 17, "tokens": 3000},
            {"hash": 5, "tokens": 100},
            {"reply_of": "a", "from": 20},
            {"hash": 6, "tokens": 40},
            {"reply_of": "b", "from": 0},
            {"hash": 9, "tokens": 16},
        ],
        "output_length": 5,
    },
]
#: a 3,100 + c 100 + b (30 answer + 40 new) + d 16
TRACE_FLOOR = 3100 + 100 + 70 + 16


def _write(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    )
    return path


def _error(tmp_path: Path, lines: list) -> str:
    with pytest.raises(TraceError) as exc:
        read_followup_trace(_write(tmp_path, lines))
    return str(exc.value)


def test_formats_are_told_apart(tmp_path: Path) -> None:
    assert trace_format(MOONCAKE_TRACE) == MOONCAKE
    assert trace_format(_write(tmp_path, TRACE)) == FOLLOWUPS
    records = read_followup_trace(_write(tmp_path, TRACE))
    assert [r.request_id for r in records] == ["a", "c", "b", "d"]
    assert [r.line for r in records] == [1, 2, 3, 4]
    assert records[1].arrival_s == 0.5 and records[2].delay_s == 1.0
    assert records[3].references() == {"a", "b"}
    assert len(read_followup_trace(_write(tmp_path, TRACE), max_requests=2)) == 2


def test_malformed_line_is_named(tmp_path: Path) -> None:
    message = _error(tmp_path, [TRACE[0], '{"id": "x", "segments": [', TRACE[1]])
    assert "line 2: not JSON" in message and "--trace" in message
    bad_segment = dict(TRACE[1], segments=[{"hash": 3}])
    assert "line 2: segment {'hash': 3} is neither" in _error(
        tmp_path, [TRACE[0], bad_segment]
    )
    both = dict(TRACE[2], timestamp=5)
    assert 'line 3: give either "timestamp" or "after"' in _error(
        tmp_path, [TRACE[0], TRACE[1], both]
    )
    zero = dict(TRACE[0], output_length=0)
    assert 'line 1: "output_length" must be a whole number >= 1' in _error(
        tmp_path, [zero]
    )


def test_unknown_and_later_ids_are_named(tmp_path: Path) -> None:
    unknown = dict(TRACE[2], after="zz")
    message = _error(tmp_path, [TRACE[0], TRACE[1], unknown])
    assert "line 3: refers to unknown id 'zz'" in message
    assert "refer only to ids of earlier lines" in message
    message = _error(tmp_path, [TRACE[2], TRACE[0]])
    assert "line 1: refers to 'a', which comes later (line 2)" in message
    past = dict(TRACE[2], segments=[{"reply_of": "a", "from": 51}])
    assert "line 2: reply of 'a' from token 51, past the 50 tokens" in _error(
        tmp_path, [TRACE[0], past]
    )
    assert "line 2: id 'a' is already used on line 1" in _error(
        tmp_path, [TRACE[0], TRACE[0]]
    )


def test_cli_stops_on_a_bad_trace_before_any_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from vllm_hybrid.tools.simulate.cli import main

    model = ["qwen3.6-35b-a3b-fp8", "--gpu-memory", "80"]
    path = _write(tmp_path, [TRACE[2], TRACE[0]])
    assert main([*model, "--trace", str(path)]) == 2
    assert "line 1: refers to 'a', which comes later" in capsys.readouterr().err
    good = _write(tmp_path, TRACE)
    assert main([*model, "--trace", str(good), "--window", "0:60"]) == 2
    assert "--window: a trace with follow-ups is cut with --requests" in (
        capsys.readouterr().err
    )


def test_follow_ups_wait_for_what_they_name(tmp_path: Path) -> None:
    workload = FollowupWorkload(read_followup_trace(_write(tmp_path, TRACE)), VOCAB)
    first = workload.due(0.0)
    assert [r.request_id for r in first] == ["a"]
    assert first[0].prompt == block_tokens(17, VOCAB, 3000) + block_tokens(
        5, VOCAB, 100
    )
    assert workload.next_arrival() == 0.5
    assert [r.request_id for r in workload.due(10.0)] == ["c"]
    assert workload.next_arrival() is None  # b waits for a
    reply = list(range(100, 150))
    workload.finished("a", reply, 12.0)
    assert workload.next_arrival() == 13.0
    assert workload.due(12.9) == []
    (b,) = workload.due(13.0)
    assert b.arrival_s == 13.0 and b.max_tokens == 30
    assert b.prompt[3100:] == reply[20:] + block_tokens(6, VOCAB, 40)
    assert len(b.prompt) == 3100 + 30 + 40


def test_a_timestamped_follow_up_waits_for_the_reply_it_quotes(tmp_path: Path) -> None:
    quoting = {
        "id": "q",
        "timestamp": 100,
        "segments": [{"reply_of": "a", "from": 0}],
        "output_length": 1,
    }
    workload = FollowupWorkload(
        read_followup_trace(_write(tmp_path, [TRACE[0], quoting])), VOCAB
    )
    assert [r.request_id for r in workload.due(5.0)] == ["a"]
    assert workload.due(5.0) == []
    workload.finished("a", [7] * 50, 8.0)
    (q,) = workload.due(8.0)
    assert q.arrival_s == 8.0 and q.prompt == [7] * 50


def test_floor_is_the_tokens_after_the_longest_shared_prefix() -> None:
    floor = PrefixFloor()
    first = list(range(1, 41))  # two full 16-token blocks and 8 more
    assert floor.unserved(first) == 40
    floor.add(first)
    assert floor.unserved(first) == 0
    assert floor.unserved(first[:20]) == 0  # a prefix of a seen sequence
    assert floor.unserved(first[:35] + [99, 98]) == 2  # leaves mid-block
    assert floor.unserved(first[:16] + [0] * 30) == 30  # leaves at a block edge
    assert floor.unserved(first + [5, 6]) == 2  # runs past a seen sequence
    assert floor.unserved([0] + first) == 41
    floor.add(first + [5, 6, 7])
    assert floor.unserved(first + [5, 6, 8, 9]) == 2


@pytest.mark.slow
def test_replies_are_the_engines_tokens_and_the_floor_is_exact(
    tiny_model_dir,
) -> None:
    from vllm_hybrid.tools.plan.geometry import EngineOptions
    from vllm_hybrid.tools.plan.request import PlanRequest
    from vllm_hybrid.tools.simulate.drive import Driver
    from vllm_hybrid.tools.simulate.engine import open_engine
    from vllm_hybrid.tools.simulate.executor import counting_tokens

    path = Path(tiny_model_dir("qwen3_6")) / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TRACE))
    sent: dict[str, list[int]] = {}
    replies: dict[str, list[int]] = {}

    class Recorded(FollowupWorkload):
        def due(self, now: float) -> list:
            out = super().due(now)
            sent.update((r.request_id, r.prompt) for r in out)
            return out

        def finished(self, request_id: str, reply: list[int], now: float) -> None:
            replies[request_id] = list(reply)
            super().finished(request_id, reply, now)

    request = PlanRequest(
        model=str(tiny_model_dir("qwen3_6")),
        kv_cache_memory=256 * 2**20,
        device="cpu",
        mamba_ssm_cache_dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        max_model_len=4096,
    )
    with open_engine(request, Path(request.model), EngineOptions()) as engine:
        vocab = engine.vocab_size()
        workload = Recorded(read_followup_trace(path), vocab)
        result = Driver(
            engine.core, workload, engine.executor.take_records, lambda _: 0.01
        ).run()
    assert result.outcome == "finished"
    tokens = counting_tokens(vocab)
    assert replies["a"] == [tokens("a", i) for i in range(50)]
    assert sent["b"][3100:3130] == replies["a"][20:]
    assert sent["d"][3170:3200] == replies["b"]
    assert sent["d"][:3170] == sent["b"]
    floors = {rid: t.floor_tokens for rid, t in result.timings.items()}
    assert floors == {"a": 3100, "c": 100, "b": 70, "d": 16}
    assert sum(floors.values()) == TRACE_FLOOR
    # every prompt token beyond the floor was there to be served
    assert result.steps.prefill_tokens >= TRACE_FLOOR
